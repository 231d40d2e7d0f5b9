"""``purlin-sglang tune --device cuda`` (loopback ranks on one GPU): a short sweep writes a table
whose every entry is an algorithm that was measured and checked correct at that size, for the
GPU in use; the planner then applies it (the device name matches)."""

from __future__ import annotations

import json

import pytest
import torch

from purlin_sglang import cli, run_virtual
from purlin_sglang.snac.table import load_table

pytestmark = pytest.mark.gpu


def test_a_short_cuda_tune_writes_verified_entries(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = cli.main(["tune", "--device", "cuda", "--worlds", "2", "--min-bytes", "4K", "--max-bytes", "256K",
                   "--factor", "8", "--iters", "3", "--warmup", "1", "--graph-calls", "4", "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.out + text.err
    data = json.loads(out.read_text())
    assert data["engine"] == "cuda" and data["device"] == torch.cuda.get_device_name()
    assert data["placement"] == "one_gpu"  # measured on virtual ranks of one GPU
    table = load_table(str(out))
    assert table.worlds == (2,)
    # every fixed collective with two algorithms here: broadcast too (packets or one-shot)
    assert set(table.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    correct = {(r["collective"], r["bytes"], r["algorithm"]) for r in data["measurements"] if r["correct"]}
    assert all(r["correct"] for r in data["measurements"])
    for name, bands in data["entries"]["2"].items():
        for size, algorithm in bands:
            assert (name, size, algorithm) in correct
    info = run_virtual(2, lambda c: c.tuning_info(), device="cuda", config={"tuning": {"table": str(out)}})
    assert info[0].bands is not None, info[0].reason
