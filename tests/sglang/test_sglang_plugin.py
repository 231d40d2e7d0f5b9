"""The plugin's SGLang side without ranks: entry point, hooks, flags, YAML, pickling, start-up errors."""

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang.srt.server_args")

import importlib.metadata as md  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from purlin_sglang.errors import PurlinConfigError  # noqa: E402
from purlin_sglang.sglang import plugin  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PURLIN_YAML = os.path.join(ROOT, "configs", "purlin.yaml")


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # discovers our entry point, runs register(), applies every hook
    return True


def parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", *argv])


def test_entry_point_is_discovered():
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "purlin_sglang"]
    assert [ep.value for ep in eps] == ["purlin_sglang.sglang.plugin:register"]
    assert eps[0].load() is plugin.register


def test_hooks_apply_and_verify(loaded):
    assert plugin.missing_hooks() == []
    plugin.verify_hooks()
    assert plugin.register() is True  # loading twice is harmless
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    assert plugin.missing_hooks() == []
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    chain, f = 0, GroupCoordinator._all_reduce_out_place
    while f is not None:  # applied once, not twice
        chain, f = chain + 1, getattr(f, "__wrapped__", None)
    assert chain == 2


def test_default_is_nccl(loaded):
    assert plugin.settings_of(parse([])) == plugin.CommSettings("nccl", None)


def test_flags_parse_in_sglang_parser(loaded):
    sa = parse(["--comm-backend", "purlin", "--purlin-config", PURLIN_YAML])
    assert plugin.settings_of(sa) == plugin.CommSettings("purlin", PURLIN_YAML)
    with pytest.raises(SystemExit):
        parse(["--comm-backend", "gloo"])


def test_yaml_config_file_and_cli_precedence(loaded, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped file names configs/purlin.yaml relative to the repository
    shipped = os.path.join(ROOT, "configs", "purlin-sglang.yaml")
    assert plugin.settings_of(parse(["--config", shipped])) == plugin.CommSettings("purlin", PURLIN_YAML)
    assert plugin.settings_of(parse(["--config", shipped, "--comm-backend", "nccl"])).backend == "nccl"
    assert plugin.settings_of(parse(["--config", os.path.join(ROOT, "configs", "nccl.yaml")])).backend == "nccl"
    own = tmp_path / "server.yaml"
    own.write_text(f"comm-backend: nccl\npurlin-config: {PURLIN_YAML}\n")
    assert plugin.settings_of(parse(["--config", str(own), "--comm-backend", "purlin"])).backend == "purlin"


def test_setting_survives_pickling(loaded):
    sa = parse(["--comm-backend", "purlin", "--purlin-config", PURLIN_YAML])
    back = pickle.loads(pickle.dumps(sa))
    assert plugin.settings_of(back) == plugin.CommSettings("purlin", PURLIN_YAML)


def test_bad_purlin_config_fails_at_parse_time(loaded, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing:\n  all_reduce: {max_byte: 4}\n")
    with pytest.raises(PurlinConfigError, match="routing.all_reduce.max_byte"):
        parse(["--comm-backend", "purlin", "--purlin-config", str(bad)])
    with pytest.raises(PurlinConfigError, match="cannot read"):
        parse(["--comm-backend", "purlin", "--purlin-config", str(tmp_path / "absent.yaml")])


_MISSING_TARGET = textwrap.dedent("""
    import contextlib, io, os, sys, tempfile
    from datetime import timedelta
    import torch.distributed as dist
    from purlin_sglang.sglang import hooks, plugin
    bogus = "sglang.srt.distributed.parallel_state.GroupCoordinator._gone_in_this_version"
    plugin.HOOKS.append((bogus, "AROUND", hooks.all_gather_into_tensor))
    plugin.WORKER_TARGETS = plugin.WORKER_TARGETS + (bogus,)
    before = plugin.missing_hooks()
    print("BEFORE", len(before) == len(plugin.HOOKS), all("hook not applied" in m or "_gone" in m for m in before))
    from sglang.srt.plugins import load_plugins
    load_plugins()   # logs the failed hook and carries on: SGLang swallows it
    from sglang.srt.server_args import prepare_server_args
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            prepare_server_args(["--model-path", "dummy", "--comm-backend", "purlin"])
            print("PARSED")
        except SystemExit as e:
            print("EXIT", e.code)
    print("CLI:", err.getvalue().strip().splitlines()[-1])
    prepare_server_args(["--model-path", "dummy"])  # nccl still starts
    print("NCCL OK")
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0, world_size=1)
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    try:
        with plugin.activate("purlin"):
            GroupCoordinator([[0]], 0, "gloo", False, False, False, False, False, False, group_name="tp")
        print("BUILT")
    except plugin.PurlinPluginError as e:
        print("WORKER:", e)
""")


def test_missing_hook_target_is_a_startup_error():
    r = subprocess.run([sys.executable, "-c", _MISSING_TARGET], capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BEFORE True True" in out, out  # targets that exist but are not hooked are reported too
    assert "EXIT 2" in out and "PARSED" not in out, out
    cli = next(line for line in out.splitlines() if line.startswith("CLI:"))
    assert "GroupCoordinator._gone_in_this_version" in cli and "sglang==0.5.23" in cli, cli
    assert "NCCL OK" in out
    worker = next(line for line in out.splitlines() if line.startswith("WORKER:"))
    assert "GroupCoordinator._gone_in_this_version" in worker and "sglang==0.5.23" in worker, worker
    assert "--comm-backend nccl" in worker


def test_import_and_register_need_no_sglang():
    code = textwrap.dedent("""
        import sys
        sys.modules["sglang"] = None          # make sglang unimportable
        import purlin_sglang.sglang.plugin as p
        import purlin_sglang.sglang.communicator, purlin_sglang.sglang.routing
        assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules if sys.modules[m])
        assert p.register() is False
        assert p.active_settings().backend == "nccl"
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


_TP1_NO_PURLIN_CODE = textwrap.dedent("""
    import os, sys, tempfile
    import torch, torch.distributed as dist
    from sglang.srt.plugins import load_plugins
    from purlin_sglang.sglang import plugin
    load_plugins()
    print("MISSING", plugin.missing_hooks())
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0, world_size=1)
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    with plugin.activate("purlin", sys.argv[1]):
        g = GroupCoordinator([[0]], 0, "gloo", False, False, False, False, False, False, group_name="tp")
    frames = []
    def prof(frame, event, arg):
        if event == "call" and "purlin_sglang" in frame.f_code.co_filename:
            frames.append(frame.f_code.co_name)
    sys.setprofile(prof)
    plugin.missing_hooks()  # the control: purlin code under the profiler is seen
    sys.setprofile(None)
    print("CONTROL", len(frames) > 0)
    frames.clear()
    x = torch.randn(8, 16)
    sys.setprofile(prof)
    for _ in range(3):  # what a decode step at TP=1 asks of its groups
        a = g.all_reduce(x)
        b = g.all_gather(x, dim=-1)
    sys.setprofile(None)
    print("SAME", torch.equal(a, x), torch.equal(b, x))
    print("PURLIN_FRAMES", sorted(set(frames)))
""")


def test_a_one_rank_group_runs_no_purlin_code_in_its_collectives():
    """TP=1 with --comm-backend purlin: SGLang's GroupCoordinator returns before any hooked method when
    its world is one rank, so a dense model's decode step (all_reduce, all_gather) runs no purlin code at
    all and TP=1 throughput cannot differ by purlin's doing (the GPU A/B, docs/RESULTS.md, cannot
    resolve 2% through the machine's noise)."""
    r = subprocess.run([sys.executable, "-c", _TP1_NO_PURLIN_CODE, PURLIN_YAML], capture_output=True, text=True,
                       timeout=300)
    out = r.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MISSING []" in out, out  # the hooks are in effect
    assert "CONTROL True" in out, out  # the profiler sees purlin code when it runs
    assert "SAME True True" in out, out
    assert "PURLIN_FRAMES []" in out, out


def test_moe_a2a_backend_purlin_is_a_choice_of_sglangs_flag(loaded, monkeypatch):
    """--moe-a2a-backend purlin: SGLang's own flag, its choice list extended; SGLang itself sees 'none' (the
    dispatcher slot the create_moe_dispatcher hook fills) and the choice travels on the record."""
    from purlin_sglang.sglang import moe_hooks

    sa = parse(["--comm-backend", "purlin", "--moe-a2a-backend", "purlin"])
    assert sa.moe_a2a_backend == "none"
    got = plugin.settings_of(sa)
    assert got == plugin.CommSettings("purlin", None, False, True)
    assert plugin.settings_of(pickle.loads(pickle.dumps(sa))).moe_a2a
    with plugin.activate("purlin", moe_a2a=True):  # no --purlin-config: the moe: defaults
        cfg = moe_hooks.purlin_moe_config()
    assert cfg is not None and cfg.max_tokens_per_rank > 0
    with plugin.activate("purlin"):  # neither the flag nor a config that names purlin: SGLang's dispatcher
        assert moe_hooks.purlin_moe_config() is None
    assert not plugin.settings_of(parse(["--comm-backend", "purlin"])).moe_a2a
    assert parse(["--comm-backend", "purlin", "--moe-a2a-backend", "none"]).moe_a2a_backend == "none"


def test_moe_a2a_backend_purlin_from_a_yaml_config(loaded, tmp_path):
    own = tmp_path / "server.yaml"
    own.write_text("comm-backend: purlin\nmoe-a2a-backend: purlin\n")
    sa = parse(["--config", str(own)])
    assert plugin.settings_of(sa).moe_a2a and sa.moe_a2a_backend == "none"


def test_moe_a2a_backend_purlin_needs_the_purlin_backend(loaded):
    from purlin_sglang.errors import PurlinPluginError

    with pytest.raises(PurlinPluginError, match="--moe-a2a-backend purlin needs --comm-backend purlin"):
        parse(["--moe-a2a-backend", "purlin"])
    with pytest.raises(SystemExit):  # still a closed list beyond purlin's name
        parse(["--comm-backend", "purlin", "--moe-a2a-backend", "no-such"])
