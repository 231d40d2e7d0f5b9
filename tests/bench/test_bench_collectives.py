"""``bench collectives`` on the CPU engine: the arithmetic, a tiny run, plots, a wrong result, CLI parsing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from purlin_sglang import cli
from purlin_sglang.bench import cases, metrics
from purlin_sglang.collectives import CATALOG

ROOT = Path(__file__).resolve().parents[2]
TINY = ["bench", "collectives", "--device", "cpu", "--world", "2", "--sizes", "1K,16K", "--iters", "2",
        "--warmup", "1", "--baselines", "none"]


@pytest.mark.parametrize("n", range(1, 9))
def test_busbw_factors(n):
    f = metrics.busbw_factor
    assert f("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert f(name, n) == pytest.approx((n - 1) / n)
        assert f(name + "_v", n) == f(name, n)  # V forms with equal splits count like fixed forms
    assert f("broadcast", n) == 1.0
    assert metrics.busbw_gbps("all_reduce", n, 10**9, 0.5) == pytest.approx(2.0 * f("all_reduce", n))
    assert metrics.algbw_gbps(10**9, 0.5) == pytest.approx(2.0)


def test_busbw_rejects_unknown():
    with pytest.raises(ValueError, match="unknown collective"):
        metrics.busbw_factor("gather", 4)
    with pytest.raises(ValueError, match="world"):
        metrics.busbw_factor("all_reduce", 0)


def test_bytes_follow_nccl_tests():
    dt = torch.bfloat16
    assert cases.make_case("all_gather", 4096, 4, dt).nbytes == 4096           # the output
    assert cases.make_case("all_gather", 4096, 4, dt).in_numel * 2 == 1024
    assert cases.make_case("reduce_scatter", 4096, 4, dt).nbytes == 4096       # the per-rank input
    assert cases.make_case("reduce_scatter", 4096, 4, dt).out_numel * 2 == 1024
    assert cases.make_case("all_to_all", 4096, 4, dt).nbytes == 4096
    assert cases.make_case("all_reduce", 1000, 8, dt).nbytes == 896  # rounded down to 16-byte slices
    assert cases.make_case("all_reduce", 8, 8, dt).nbytes == 128    # at least one 16-byte slice per rank


def test_percentiles():
    assert metrics.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert metrics.percentile(list(range(11)), 10) == pytest.approx(1.0)
    assert metrics.percentile(list(range(11)), 90) == pytest.approx(9.0)


def test_size_parsing():
    assert [metrics.parse_size(s) for s in ("4096", "1K", "64KiB", "1M", "2MB", "1G")] == [
        4096, 1024, 65536, 1 << 20, 2 << 20, 1 << 30]
    with pytest.raises(ValueError, match="bad size"):
        metrics.parse_size("12Q")
    assert metrics.size_sweep(1024, 1 << 20, 4) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]


def test_cli_parses_sizes_and_defaults():
    from purlin_sglang.bench import collectives as bc
    import argparse

    p = argparse.ArgumentParser()
    bc.add_arguments(p)
    a = bc.resolve(p.parse_args(["--device", "cpu", "--sizes", "1K,64K,1M", "--world", "2,3"]))
    assert a.sizes == [1024, 65536, 1 << 20] and a.world == [2, 3]
    a = bc.resolve(p.parse_args(["--device", "cpu"]))
    assert a.sizes[0] == 1024 and a.sizes[-1] == 1 << 20 and a.world == [4] and a.modes == ["eager"]
    assert a.collectives == list(CATALOG) and a.baselines == ["gloo"]
    a = bc.resolve(p.parse_args(["--device", "cpu", "--min-bytes", "2K", "--max-bytes", "8K", "--factor", "2"]))
    assert a.sizes == [2048, 4096, 8192]
    with pytest.raises(SystemExit):
        p.parse_args(["--sizes", "1K,huge"])
    with pytest.raises(ValueError, match="not both"):
        bc.resolve(p.parse_args(["--device", "cpu", "--sizes", "1K", "--factor", "2"]))


def test_tiny_cpu_run(tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(TINY + ["--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.out
    data = json.loads((out / "results.json").read_text())
    env = data["environment"]
    for key in ("date", "gpu", "torch", "purlin_sglang", "native_build_info"):
        assert key in env
    rows = data["rows"]
    assert {r["collective"] for r in rows} == set(CATALOG)
    assert {r["bytes"] for r in rows} == {1024, 16384}
    assert len(rows) == 2 * len(CATALOG)
    for r in rows:
        assert r["correct"] is True and r["engine"] == "cpu" and r["mode"] == "eager" and r["world"] == 2
        assert r["time_us_p10"] <= r["time_us_median"] <= r["time_us_p90"]
        assert r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"] * metrics.busbw_factor(r["collective"], 2))
        # the algorithm the CPU engine ran (it has no packets) and what its plan moves (bench/traffic.py)
        assert r["algorithm"] == "oneshot" and r["plan_bytes"] > 0
        assert r["floor_bytes"] == 2 * (r["in_bytes"] + r["out_bytes"])
        assert 0 < r["plan_of_floor_max"] <= 1.0
    assert "all_to_all_v" in text.out and "16 of 16 results correct" in text.out
    assert "purlin eager world 2 all_reduce" in text.err  # progress goes to stderr


def test_symmetric_inputs_run_the_direct_plans(tmp_path, capsys):
    """``--symmetric``: purlin's inputs in its symmetric heap; the collectives with a direct form read
    their peers' inputs in place (all_to_all_v has none and stays staged), every row correct."""
    out = tmp_path / "res"
    rc = cli.main(TINY + ["--symmetric", "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.out
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 2 * len(CATALOG) and all(r["correct"] and r["engine"] == "cpu+heap" for r in rows)
    algs = {r["collective"]: r["algorithm"] for r in rows}
    assert algs == {n: "oneshot" if n == "all_to_all_v" else "direct" for n in CATALOG}, algs
    assert "purlin-cpu+heap" in text.out


def test_plot_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from purlin_sglang.bench.plot import plot_results

    rows = [{"impl": "purlin", "collective": c, "mode": "eager", "world": 2, "bytes": b,
             "time_us_median": 10.0 * b, "busbw_GBps": 0.1 * b} for c in ("all_reduce", "broadcast")
            for b in (1024, 4096)]
    rows.append({"impl": "gloo", "collective": "all_reduce", "mode": "eager", "world": 2, "bytes": 1024,
                 "time_us_median": 5.0, "busbw_GBps": 1.0})
    paths, why = plot_results(rows, tmp_path)
    assert why is None
    assert [p.name for p in paths] == ["plot-eager-world2.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_result_exits_nonzero(tmp_path, capsys, monkeypatch):
    real = cases.reference

    def broken(case, xs, rank):
        want = real(case, xs, rank)
        return want + 1 if case.collective == "all_gather" else want

    monkeypatch.setattr(cases, "reference", broken)
    out = tmp_path / "res"
    rc = cli.main(TINY + ["--collectives", "all_gather,all_reduce", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["collective"] for r in rows if not r["correct"]} == {"all_gather"}
    assert " NO" in text and "2 of 4 results correct" in text


@pytest.mark.parametrize("argv,says", [
    (["--collectives", "broadcast", "--modes", "eager,graph"],
     "bench collectives: --modes graph needs CUDA (CUDA graphs), but the device is cpu"),
    (["--collectives", "all_reduce", "--baselines", "nccl,symm_mem,sglang"],
     "baseline(s) ['nccl', 'symm_mem', 'sglang'] cannot run on the cpu engine"),
], ids=["graph-mode", "gpu-baselines"])
def test_what_needs_cuda_is_refused_on_cpu_before_anything_runs(argv, says, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(TINY + argv + ["--out", str(out)])
    text = capsys.readouterr()
    assert rc == 2 and text.out == "" and says in text.err
    assert not out.exists()


def test_module_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "purlin_sglang.bench", "collectives", "--help"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    for opt in ("--min-bytes", "--max-bytes", "--factor", "--sizes", "--world", "--modes", "--baselines", "--out"):
        assert opt in r.stdout


def test_gloo_baseline_in_the_same_run(tmp_path, capsys):
    """The baseline launcher (spawned torch.distributed workers) on CPU, where gloo stands in for NCCL."""
    args = [a for a in TINY if a not in ("--baselines", "none")]
    rc = cli.main(args + ["--collectives", "all_reduce,all_gather", "--sizes", "1K", "--baselines", "gloo",
                          "--out", str(tmp_path)])
    text = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, text
    gloo = [r for r in data["rows"] if r["impl"] == "gloo"]
    assert {r["collective"] for r in gloo} == {"all_reduce", "all_gather"}
    assert all(r["correct"] and r["time_us_median"] > 0 for r in gloo)


def test_table_with_a_floor_names_the_plans_best_fraction_and_algorithm():
    """With a measured floor (GPU runs), each purlin row ends with its floor, the fraction reached, the
    plan's best fraction (bench/traffic.py) and the algorithm; a row without plan bytes shows '-'."""
    from purlin_sglang.bench.collectives import format_table

    base = {"impl": "purlin", "engine": "cuda", "collective": "all_reduce", "mode": "graph", "world": 8,
            "bytes": 1 << 20, "time_us_median": 10.0, "time_us_p10": 9.0, "time_us_p90": 11.0,
            "algbw_GBps": 1.0, "busbw_GBps": 1.75, "correct": True, "floor_us": 5.0, "of_floor": 0.5}
    text = format_table([{**base, "plan_of_floor_max": 0.41, "algorithm": "twoshot"}, base],
                        {"copy_GBps": 4000.0, "latency_us": 2.0})
    lines = text.splitlines()
    assert "plan max" in lines[0] and "algorithm" in lines[0]
    assert lines[1].split()[-3:] == ["0.50", "0.41", "twoshot"]
    assert lines[2].split()[-3:] == ["0.50", "-", "-"]
    assert "plan max: the best 'of floor'" in lines[-1]
