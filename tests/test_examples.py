"""The SGLang examples without a GPU: the tiny model directory loads offline with transformers, the
launch_server commands parse in SGLang's own parser with the plugin, offline_compare.sh's dry run."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _maker():
    spec = importlib.util.spec_from_file_location("make_tiny_model", EXAMPLES / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("tokenizers")
    out = tmp_path_factory.mktemp("tiny") / "model"
    _maker().write_model(out)
    return out


def test_tiny_model_is_deterministic(tiny_model, tmp_path):
    again = tmp_path / "again"
    _maker().write_model(again)
    names = sorted(p.name for p in tiny_model.iterdir())
    assert names == ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert all((tiny_model / n).read_bytes() == (again / n).read_bytes() for n in names)
    with pytest.raises(ValueError, match="multiple of --heads"):
        _maker().write_model(tmp_path / "bad", hidden=100, heads=8)


def test_tiny_model_loads_offline_with_transformers(tiny_model, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True, raising=False)
    from transformers import AutoConfig, AutoTokenizer

    from purlin_sglang.bench.offline import WORDS

    cfg = AutoConfig.from_pretrained(str(tiny_model))
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.vocab_size == len(tok) and cfg.num_hidden_layers == 2
    assert all(cfg.num_attention_heads % tp == 0 and cfg.num_key_value_heads % tp == 0 for tp in (1, 2, 4, 8))
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    text = " ".join(WORDS[:40]) + ", and: What is 42?"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.num_special_tokens_to_add() == 1
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: any text round-trips
    assert len(ids) < len(text) // 2  # the word list is in the vocabulary, not spelled out byte by byte


def _dry(script: str, *args: str) -> str:
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(EXAMPLES / script), *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("mode, backend", [("flags", "purlin"), ("yaml", "purlin"), ("nccl", "nccl")])
def test_launch_server_example_parses_in_sglang(mode, backend, tmp_path, monkeypatch):
    pytest.importorskip("sglang.srt.server_args")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # present: the script does not make one
    argv = shlex.split(_dry("launch_server_purlin.sh", mode, str(model), "2", "--mem-fraction-static", "0.5"))
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from purlin_sglang.sglang import plugin

    load_plugins()
    monkeypatch.chdir(ROOT)  # as the script does: the configs name configs/purlin.yaml
    sa = prepare_server_args(argv[3:])
    assert plugin.settings_of(sa).backend == backend
    assert (sa.model_path, sa.load_format, sa.tp_size, sa.mem_fraction_static) == (str(model), "dummy", 2, 0.5)
    if backend == "purlin":
        assert plugin.settings_of(sa).config_path == str(ROOT / "configs" / "purlin.yaml")


def test_launch_server_example_rejects_an_unknown_mode():
    r = subprocess.run(["bash", str(EXAMPLES / "launch_server_purlin.sh"), "grpc"], capture_output=True, text=True)
    assert r.returncode == 2 and "use flags, yaml or nccl" in r.stderr


def test_offline_compare_example_dry_run(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = _dry("offline_compare.sh", str(model), "2", "--dry-run", "--num-prompts", "8", "--out", str(tmp_path / "o"))
    runs = [shlex.split(line.split(": ", 1)[1]) for line in out.splitlines() if line.startswith("[")]
    assert [r[r.index("--comm-backend") + 1] for r in runs] == ["nccl", "purlin"]
    for r in runs:
        assert r[r.index("--load-format") + 1] == "dummy" and r[r.index("--tp-size") + 1] == "2"
        assert r[r.index("--model-path") + 1] == str(model) and r[r.index("--num-prompts") + 1] == "8"
    assert len(json.loads((tmp_path / "o" / "dataset.json").read_text())) == 16
