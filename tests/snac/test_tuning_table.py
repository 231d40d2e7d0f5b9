"""Tuning tables (snac/table.py, ``tuning.table``): ``purlin-sglang tune`` writes a valid one, a
table changes the algorithm the call path takes (and the results stay bitwise equal), a table
of another device is not applied and says why, a malformed one is a PurlinConfigError naming
the field, and ``info`` shows the table in force. CPU only."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from purlin_sglang import cli, run_virtual
from purlin_sglang.errors import PurlinConfigError
from purlin_sglang.reference import all_reduce as ref_all_reduce
from purlin_sglang.snac import TuningPolicy, choose_algorithm
from purlin_sglang.snac.table import load_table
from purlin_sglang.collectives import CATALOG

SIZES = (256, 4096, 1 << 20)  # bytes of a float32 all_reduce input on each rank


def write(tmp_path, entries, name="table.json", **top):
    p = tmp_path / name
    p.write_text(json.dumps({"format": 1, "device": "cpu", "engine": "cpu", "date": "x", "command": "x",
                             "purlin_sglang": "x", "entries": entries, "measurements": [], **top}))
    return str(p)


def run_all_reduce(config):
    """(algorithm chosen, output) of one all_reduce per size on 2 CPU ranks; inputs fixed per rank."""
    def fn(comm):
        out = []
        for n in SIZES:
            x = torch.randn(n // 4, generator=torch.Generator().manual_seed(comm.rank * 7 + n))
            out.append((comm.algorithm("all_reduce", n), comm.all_reduce(x)))
        return out, comm.tuning_info()

    return run_virtual(2, fn, config=config)


def test_tune_cpu_writes_a_valid_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = cli.main(["tune", "--device", "cpu", "--worlds", "2,3", "--min-bytes", "1K", "--max-bytes", "16K",
                   "--iters", "2", "--warmup", "0", "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.out + text.err
    assert "tune:" in text.err  # progress on stderr
    data = json.loads(out.read_text())
    assert {k: data[k] for k in ("format", "device", "engine")} == {"format": 1, "device": "cpu", "engine": "cpu"}
    assert data["command"].startswith("purlin-sglang tune") and data["purlin_sglang"] and data["date"]
    assert data["placement"] == "any"  # CPU; a CUDA tune (virtual ranks on one GPU) writes one_gpu
    table = load_table(str(out))  # validates
    assert table.worlds == (2, 3) and table.collectives == ("all_reduce",)  # the CPU engine's only choice
    rows = data["measurements"]
    assert rows and all(r["correct"] for r in rows)
    assert {r["algorithm"] for r in rows} == {"oneshot", "twoshot"}
    for w, per in data["entries"].items():
        bands = per["all_reduce"]
        assert [b[0] for b in bands] == sorted({b[0] for b in bands})
        assert all(a != b for (_, a), (_, b) in zip(bands, bands[1:]))  # equal neighbours merged
        # each band's algorithm was the fastest at its upper size
        at = {(r["bytes"], r["algorithm"]): r["median_us"] for r in rows if r["world"] == int(w)}
        for size, alg in bands:
            assert at[(size, alg)] == min(v for (s, _), v in at.items() if s == size)


def test_crossover_midpoints_lie_between_neighbours_whose_winners_differ():
    from purlin_sglang.bench.tune import crossover_midpoints

    t = {1024: {"packet": 1.0, "oneshot": 2.0}, 4096: {"packet": 1.0, "oneshot": 2.0},
         16384: {"packet": 3.0, "oneshot": 2.0}, 65536: {"packet": 3.0, "oneshot": 2.0},
         262144: {"oneshot": 2.0, "twoshot": 1.0}}
    assert crossover_midpoints(t) == [8192, 131072]
    assert crossover_midpoints({1024: {"a": 1.0}, 4096: {"a": 1.0}}) == []
    assert crossover_midpoints({1024: {"a": 1.0, "b": 2.0}, 1088: {"a": 2.0, "b": 1.0}}) == []  # nothing between
    assert crossover_midpoints({1000: {"a": 1.0, "b": 2.0}, 3000: {"a": 2.0, "b": 1.0}}) == [1728]  # 64-byte steps


def test_tune_refine_measures_between_the_grid_sizes_where_the_winner_changes(tmp_path, capsys):
    """--refine 1: the midpoint of each grid neighbour pair whose fastest algorithms differ is measured too,
    and nowhere else; the bands come from every measured size. The CPU engine's timings are noisy, so the
    run's own measurements say where the winner changed."""
    out = tmp_path / "t.json"
    rc = cli.main(["tune", "--device", "cpu", "--worlds", "2", "--min-bytes", "1K", "--max-bytes", "64K",
                   "--factor", "4", "--refine", "1", "--iters", "2", "--warmup", "0", "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.out + text.err
    rows = json.loads(out.read_text())["measurements"]
    at: dict[int, dict[str, float]] = {}
    for r in rows:
        at.setdefault(r["bytes"], {})[r["algorithm"]] = r["median_us"]
    grid = [1024, 4096, 16384, 65536]
    best = {b: min(at[b], key=at[b].get) for b in at}
    extra = sorted(set(at) - set(grid))
    want = [m for a, b in zip(grid, grid[1:]) if best[a] != best[b] for m in sorted(at) if a < m < b]
    assert extra == want and len(extra) == sum(best[a] != best[b] for a, b in zip(grid, grid[1:]))
    assert ("crossover sizes" in text.err) == bool(extra)
    bands = json.loads(out.read_text())["entries"]["2"]["all_reduce"]
    for size, alg in bands:
        assert best[size] == alg


def test_a_table_changes_the_algorithm_and_not_the_bits(tmp_path):
    path = write(tmp_path, {"2": {"all_reduce": [[1024, "twoshot"], [8192, "oneshot"], [1 << 30, "twoshot"]]}})
    builtin = run_all_reduce({"timeout_s": 20})
    tuned = run_all_reduce({"timeout_s": 20, "tuning": {"table": path}})
    assert [a for a, _ in builtin[0][0]] == ["oneshot", "oneshot", "twoshot"]  # the thresholds
    assert [a for a, _ in tuned[0][0]] == ["twoshot", "oneshot", "twoshot"]
    assert tuned[0][1].bands == {"all_reduce": ((1024, "twoshot"), (8192, "oneshot"), (1 << 30, "twoshot"))}
    assert builtin[0][1].bands is None and "built-in thresholds" in builtin[0][1].reason
    xs = {n: [torch.randn(n // 4, generator=torch.Generator().manual_seed(r * 7 + n)) for r in range(2)]
          for n in SIZES}
    for r in range(2):
        for i, n in enumerate(SIZES):
            want = ref_all_reduce(xs[n], r)
            assert torch.equal(tuned[r][0][i][1], want) and torch.equal(builtin[r][0][i][1], want)


def test_a_forced_algorithm_wins_over_the_table(tmp_path):
    path = write(tmp_path, {"2": {"all_reduce": [[1 << 30, "twoshot"]]}})
    got = run_virtual(2, lambda c: c.algorithm("all_reduce", 256),
                      config={"tuning": {"table": path, "algorithm": "oneshot"}})
    assert got == ["oneshot", "oneshot"]


def test_the_table_packet_band_needs_the_protocol_and_the_window():
    spec, policy = CATALOG["all_gather"], TuningPolicy()
    bands = ((1 << 30, "packet"),)
    assert choose_algorithm(spec, 1024, policy, packets=True, world=4, bands=bands) == "packet"
    assert choose_algorithm(spec, 1 << 20, policy, packets=True, world=4, bands=bands) == "oneshot"  # > window
    ar = CATALOG["all_reduce"]
    # no packet protocol (CPU engine): the built-in thresholds decide
    assert choose_algorithm(ar, 1 << 20, policy, packets=False, world=4, bands=bands) == "twoshot"
    assert choose_algorithm(ar, None, policy, packets=True, world=4, bands=((1 << 30, "oneshot"),)) == "twoshot"


def test_a_table_for_another_device_or_world_is_not_applied(tmp_path, caplog):
    other = write(tmp_path, {"2": {"all_reduce": [[1 << 30, "twoshot"]]}}, "h200.json",
                  device="NVIDIA H200", engine="cuda")
    with caplog.at_level(logging.INFO, logger="purlin_sglang"):
        got = run_virtual(2, lambda c: (c.algorithm("all_reduce", 256), c.tuning_info()),
                          config={"tuning": {"table": other}})
    alg, info = got[0]
    assert alg == "oneshot" and info.bands is None
    assert "NVIDIA H200" in info.reason and "not applied" in info.reason
    assert any("not applied" in r.getMessage() for r in caplog.records)
    world3 = run_virtual(3, lambda c: c.tuning_info(), config={"tuning": {"table": write(
        tmp_path, {"2": {"all_reduce": [[1 << 30, "twoshot"]]}}, "w2.json")}})
    assert world3[0].bands is None and "no entry for world 3" in world3[0].reason


def test_a_table_applies_only_to_communicators_placed_as_it_was_measured(tmp_path):
    """Loopback crossovers (every rank in one GPU's HBM) must not steer a process per GPU, and back."""
    entries = {"2": {"all_reduce": [[1 << 30, "twoshot"]]}}
    virtual = lambda path: run_virtual(2, lambda c: (c.algorithm("all_reduce", 256), c.tuning_info()),  # noqa: E731
                                       config={"tuning": {"table": path}})[0]
    alg, info = virtual(write(tmp_path, entries, "per-gpu.json", placement="gpu_per_rank"))
    assert alg == "oneshot" and info.bands is None
    assert "placement gpu_per_rank" in info.reason and "one_gpu" in info.reason and "not applied" in info.reason
    for placement in ("one_gpu", "any"):
        alg, info = virtual(write(tmp_path, entries, f"{placement}.json", placement=placement))
        assert alg == "twoshot" and info.bands is not None, (placement, info.reason)
    alg, info = virtual(write(tmp_path, entries, "none.json"))  # no field: any
    assert alg == "twoshot"
    from purlin_sglang.snac.table import bands_for
    one_gpu = write(tmp_path, entries, "one.json", placement="one_gpu")
    assert bands_for(one_gpu, "cpu", "cpu", 2, "gpu_per_rank").bands is None
    assert bands_for(one_gpu, "cpu", "cpu", 2, "one_gpu").bands is not None


@pytest.mark.parametrize("entries, top, field", [
    ({}, {"placement": "nvlink"}, "placement"),
    ({"2": {"all_reduce": [[1024, "threeshot"]]}}, {}, "entries.2.all_reduce[0]"),
    ({"2": {"all_gather": [[1024, "twoshot"]]}}, {}, "entries.2.all_gather[0]"),
    ({"2": {"all_reduce": [[4096, "oneshot"], [1024, "twoshot"]]}}, {}, "entries.2.all_reduce[1]"),
    ({"2": {"all_reduce": [["1K", "oneshot"]]}}, {}, "entries.2.all_reduce[0]"),
    ({"2": {"all_reduce": []}}, {}, "entries.2.all_reduce"),
    ({"2": {"allreduce": [[1, "oneshot"]]}}, {}, "entries.2.allreduce"),
    ({"two": {}}, {}, "entries.two"),
    ([], {}, "entries"),
    ({}, {"format": 2}, "format"),
    ({}, {"device": ""}, "device"),
    ({}, {"engine": "tpu"}, "engine"),
])
def test_a_malformed_table_names_the_field(tmp_path, entries, top, field):
    path = write(tmp_path, entries, **top)
    with pytest.raises(PurlinConfigError) as e:
        run_virtual(2, lambda c: None, config={"tuning": {"table": path}})
    assert "tuning.table" in str(e.value) and f"'{field}'" in str(e.value)


def test_an_unreadable_table_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, what in ((str(bad), "not valid JSON"), (str(tmp_path / "missing.json"), "cannot read")):
        with pytest.raises(PurlinConfigError, match=what):
            load_table(path)


def test_info_shows_the_table_in_force(tmp_path, capsys):
    assert cli.main(["info"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tuning table:")][0]
    assert "shipped" in line and "h200-one-gpu.json" in line and "h100-one-gpu.json" in line
    assert "placement one_gpu" in line
    assert "built-in thresholds" in line  # this machine is not an H200
    cfg = tmp_path / "thresholds.yaml"
    cfg.write_text("tuning:\n  table: thresholds\n")
    assert cli.main(["info", "--config", str(cfg)]) == 0
    assert "tuning.table: thresholds" in capsys.readouterr().out
    path = write(tmp_path, {"2": {"all_reduce": [[1 << 30, "twoshot"]]}, "4": {"all_reduce": [[1, "oneshot"]]}})
    cfg = tmp_path / "purlin.yaml"
    cfg.write_text(f"tuning:\n  table: {path}\n")
    assert cli.main(["info", "--config", str(cfg)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tuning table:")][0]
    assert path in line and "device cpu" in line and "[2, 4]" in line and "all_reduce" in line


def test_the_shipped_tables_are_the_default_where_they_were_measured_only():
    """purlin_sglang/tables/ ships two tables, each measured with virtual ranks on one GPU: h100-one-gpu.json
    (an H100 80GB HBM3, refined crossovers) and h200-one-gpu.json (an H200). With
    tuning.table unset each steers virtual worlds on its own GPU model and nothing else;
    tuning.table: thresholds turns them off."""
    from purlin_sglang.snac.table import THRESHOLDS, bands_for, shipped_tables

    names = [p.rsplit("/", 1)[-1] for p in shipped_tables()]
    assert names == ["h100-one-gpu.json", "h200-one-gpu.json"]
    h100, h200 = (load_table(p) for p in shipped_tables())
    assert (h100.device, h100.engine, h100.placement) == ("NVIDIA H100 80GB HBM3", "cuda", "one_gpu")
    assert (h200.device, h200.engine, h200.placement) == ("NVIDIA H200", "cuda", "one_gpu")
    for table in (h100, h200):
        assert table.worlds == (2, 4, 8)
        assert set(table.collectives) >= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
        for world in table.worlds:
            used = bands_for(None, table.device, "cuda", world, "one_gpu")
            assert used.path == table.path and used.bands == table.entries[world], (table.device, world)
            assert used.reason.startswith("shipped ") and table.device in used.reason
    used = bands_for(None, "NVIDIA H200", "cuda", 8, "one_gpu")
    # world 8, 1 MiB all_reduce: the measured one-shot band (two-shot by the thresholds)
    assert choose_algorithm(CATALOG["all_reduce"], 1 << 20, TuningPolicy(), packets=True, world=8,
                            bands=used.bands["all_reduce"]) == "oneshot"
    assert choose_algorithm(CATALOG["all_reduce"], 1 << 20, TuningPolicy(), packets=True, world=8) == "twoshot"
    # world 8, 128 KiB all_reduce: packets (within the 256 KiB window), one-shot by the thresholds
    assert choose_algorithm(CATALOG["all_reduce"], 128 << 10, TuningPolicy(), packets=True, world=8,
                            bands=used.bands["all_reduce"]) == "packet"
    assert choose_algorithm(CATALOG["all_reduce"], 128 << 10, TuningPolicy(), packets=True, world=8) == "oneshot"
    # the H100's world 8: the refined crossover (181 KiB measured between 128 and 256 KiB) keeps 128 KiB on
    # packets and sends 256 KiB to the one-shot; reduce_scatter keeps packets to 2 MiB of input
    h100_8 = bands_for(None, "NVIDIA H100 80GB HBM3", "cuda", 8, "one_gpu").bands
    for name, nbytes, algorithm in (("all_reduce", 128 << 10, "packet"), ("all_reduce", 256 << 10, "oneshot"),
                                    ("all_reduce", 16 << 20, "twoshot"), ("reduce_scatter", 2 << 20, "packet")):
        assert choose_algorithm(CATALOG[name], nbytes, TuningPolicy(), packets=True, world=8,
                                bands=h100_8[name]) == algorithm, (name, nbytes)
    for args in (("NVIDIA H200", "cuda", 8, "gpu_per_rank"),  # a process per GPU: NVLink, not HBM
                 ("NVIDIA H100 80GB HBM3", "cuda", 8, "gpu_per_rank"),
                 ("NVIDIA H100 PCIe", "cuda", 8, "one_gpu"),  # another model: the name must match
                 ("NVIDIA H200", "cuda", 3, "one_gpu"),
                 ("cpu", "cpu", 2, "one_gpu")):
        used = bands_for(None, *args)
        assert used.bands is None and "built-in thresholds" in used.reason, (args, used.reason)
    off = bands_for(THRESHOLDS, "NVIDIA H200", "cuda", 8, "one_gpu")
    assert off.bands is None and "thresholds" in off.reason
    # the CPU engine's default is unchanged: no shipped CPU table
    info = run_virtual(2, lambda c: c.tuning_info())[0]
    assert info.bands is None and "no shipped table for cpu" in info.reason
