"""``bench moe`` on the CPU engine: a tiny run end to end, the check catching a wrong result, options."""

import json

import pytest
import torch

from purlin_sglang import cli
from purlin_sglang.bench import moe, moe_check, moe_report

TINY = ["bench", "moe", "--device", "cpu", "--world", "4", "--experts", "8", "--topk", "2", "--hidden", "16",
        "--iters", "2", "--warmup", "0", "--drop-every", "3"]


def test_tiny_run_writes_json_table_and_chart(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main(TINY + ["--tokens", "0,5", "--out", str(out)]) == 0
    text = capsys.readouterr()
    result = json.loads((out / "moe.json").read_text())
    rows = result["rows"]
    # per (tokens, dtype): dispatch, combine, pair; the torch reference once per token count
    assert [(r["impl"], r["op"], r["dtype"], r["tokens"]) for r in rows] == [
        ("purlin", "dispatch", "bf16", 0), ("purlin", "combine", "bf16", 0), ("purlin", "pair", "bf16", 0),
        ("torch-ref", "pair", "bf16", 0), ("purlin", "dispatch", "fp8", 0), ("purlin", "combine", "fp8", 0),
        ("purlin", "pair", "fp8", 0), ("purlin", "dispatch", "bf16", 5), ("purlin", "combine", "bf16", 5),
        ("purlin", "pair", "bf16", 5), ("torch-ref", "pair", "bf16", 5), ("purlin", "dispatch", "fp8", 5),
        ("purlin", "combine", "fp8", 5), ("purlin", "pair", "fp8", 5)]
    assert all(r["correct"] for r in rows), rows
    purlin5 = [r for r in rows if r["impl"] == "purlin" and r["tokens"] == 5]
    assert all(r["bitwise_vs_reference"] is True for r in purlin5)
    assert all(0 <= r["err_over_bound"] <= 1 for r in purlin5)
    assert all(r["iters"] == 2 and r["time_us_median"] > 0 and r["mode"] == "eager" for r in rows)
    # bytes: 5 tokens x 4 ranks; the dispatch moves each token once per destination rank (<= 2), the
    # combine one bf16 row per valid slot (every 3rd token, 0 and 3, drops its second slot)
    comb = next(r for r in purlin5 if r["op"] == "combine" and r["dtype"] == "bf16")
    assert comb["bytes"] == 4 * (5 * 2 - 2) * 16 * 2
    disp = {r["dtype"]: r["bytes"] for r in purlin5 if r["op"] == "dispatch"}
    assert disp["bf16"] // (16 * 2) == disp["fp8"] // (16 + 4)  # the same token rows, FP8 rows are 16 B + scale
    assert 4 * 5 <= disp["bf16"] // 32 <= 4 * 5 * 2
    assert result["floor"] is None and result["failures"] == []
    assert "purlin    pair" in text.out and "14 of 14 results correct" in text.out
    assert "ceil us" not in text.out and "no ceiling columns" in text.out  # the CPU has no copy rate
    for r in rows:  # ... but every row has the fields, null
        assert r["ceiling_us"] is None and r["of_ceiling"] is None and r["over_ceiling_us"] is None, r
    assert "[4/4] tokens 5, fp8" in text.err
    pytest.importorskip("matplotlib")
    assert (out / "moe.png").stat().st_size > 0


def test_a_misrouted_result_fails_the_run(tmp_path, monkeypatch, capsys):
    """Experts that apply the neighbouring expert's function: the float64 check must catch it."""
    real = moe_check.run_experts

    def wrong(rows, scales, local_expert, rank, local, s, out=None):
        return real(rows, scales, (local_expert + 1) % local, rank, local, s, out)

    monkeypatch.setattr(moe, "run_experts", wrong)
    assert cli.main(TINY + ["--tokens", "6", "--dtypes", "bf16", "--no-reference", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert rows and not any(r["correct"] for r in rows)
    assert all(r["err_over_bound"] > 1 and r["bitwise_vs_reference"] is False for r in rows)
    assert "0 of 3 results correct" in capsys.readouterr().out


def test_options_are_checked(capsys):
    assert cli.main(["bench", "moe", "--device", "cpu", "--world", "3", "--experts", "8"]) == 2
    assert "multiple of --world 3" in capsys.readouterr().err
    assert cli.main(["bench", "moe", "--device", "cpu", "--dtypes", "fp16"]) == 2
    assert "unknown --dtypes ['fp16']" in capsys.readouterr().err
    assert cli.main(["bench", "moe", "--device", "cpu", "--mode", "graph"]) == 2
    assert "--mode graph needs --device cuda" in capsys.readouterr().err


def test_wire_bytes_and_capacity_fit():
    ids = [torch.tensor([[0, 1], [0, 5], [7, -1]], dtype=torch.int32), torch.tensor([[2, 3]], dtype=torch.int32)]
    # world 2, 8 experts (4 per rank): token rows to rank 0: 1 + 1 + 0 + 1, to rank 1: 0 + 1 + 1 + 0
    d, c = moe_check.wire_bytes(ids, 8, 2, 10, None)
    assert d == 5 * 10 * 2 and c == 7 * 10 * 2
    d8, _ = moe_check.wire_bytes(ids, 8, 2, 10, torch.float8_e4m3fn)
    assert d8 == 5 * (10 + 4)
    assert moe_check.max_pair_load(ids, 8) == 2  # rank 0 sends expert 0 two rows


def test_rows_against_a_copy_ceiling():
    """The GPU rows' arithmetic (a floor as bench/floor.py measures it), from made-up samples."""
    import argparse

    args = argparse.Namespace(world=2, experts=4, hidden=8, topk=2, mode="graph")
    ids = [torch.tensor([[0, 3]], dtype=torch.int32), torch.tensor([[1, 2]], dtype=torch.int32)]
    inputs = [moe_check.Inputs(torch.zeros(1, 8), i, torch.ones(1, 2)) for i in ids]
    rank = {"ok": True, "pair_ok": True, "err": 0.0, "ratio": 0.5, "rows": 4, "hbm": 1 << 20, "moe_hbm": 1 << 19,
            "workspace": 2 << 20, "graph_calls": 10, "y": None, "dispatch": [1e-5, 2e-5], "combine": [3e-5, 1e-5],
            "pair": [4e-5, 4e-5], "reference": [9e-5, 9e-5], "ref_ok": True, "ref_err": 0.0}
    slow = {**rank, "dispatch": [2e-5, 1e-5]}
    rows = moe.make_rows(args, 1, "bf16", {"inputs": inputs, "capacity": 16, "ranks": [rank, slow]},
                         {"copy_GBps": 1.0})
    by_op = {r["op"]: r for r in rows if r["impl"] == "purlin"}
    # every token goes to both ranks (experts 0,1 on rank 0; 2,3 on rank 1): 4 rows of 8 bf16
    assert by_op["dispatch"]["bytes"] == 4 * 16 and by_op["combine"]["bytes"] == 4 * 16
    assert by_op["dispatch"]["time_us_median"] == pytest.approx(20.0)  # slowest rank per iteration: 20, 20
    assert by_op["dispatch"]["ceiling_us"] == pytest.approx(2 * 64 / 1e9 * 1e6)
    assert by_op["pair"]["of_ceiling"] == pytest.approx(by_op["pair"]["ceiling_us"] / 40.0)
    assert by_op["pair"]["over_ceiling_us"] == pytest.approx(40.0 - by_op["pair"]["ceiling_us"])
    assert by_op["pair"]["moe_hbm_bytes"] == 1 << 19 and by_op["pair"]["capacity"] == 16
    assert by_op["pair"]["bitwise_vs_reference"] is None  # no eager results to compare
    assert all(r["ceiling_us"] is not None for r in rows if r["impl"] == "purlin")
    assert rows[-1]["impl"] == "torch-ref" and rows[-1]["ceiling_us"] is None  # no byte count: no ceiling
    table = moe_report.format_table(rows, {"copy_GBps": 1.0, "copy_measured": "made up"})
    assert table.splitlines()[-3].split()[-4:-1] == ["-", "-", "-"]  # the reference's ceiling columns
    assert "ceil us" in table and "ceiling: 2 x bytes" in table and "copy bandwidth 1 GB/s (made up)" in table


def test_cuda_rows_name_the_kernels_that_ran():
    """A row's ``path``: the decode kernels up to moe.decode_tokens (the default, or --decode-tokens), else
    the one-pass or receive-slot kernels."""
    import argparse

    def args(decode, one_pass="on"):
        return argparse.Namespace(decode_tokens=decode, one_pass=one_pass)

    assert moe.cuda_path(args(None), 1) == "one-pass"  # the default: off
    assert moe.cuda_path(args(8), 1) == "decode" and moe.cuda_path(args(8), 9) == "one-pass"
    assert moe.cuda_path(args(0), 1) == "one-pass" and moe.cuda_path(args(0, "off"), 1) == "slots"
    assert moe.cuda_path(args(16, "off"), 16) == "decode" and moe.cuda_path(args(16, "off"), 17) == "slots"
