"""The two-level model's tables are the ones docs/MULTINODE.md prints (the doc is regenerated from
``python -m purlin_sglang.bench.multinode_model``), and the model moves with its assumptions."""

import contextlib
import io
from pathlib import Path

from purlin_sglang.bench import multinode_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "MULTINODE.md"


def _run(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert multinode_model.main(list(argv)) == 0
    return buf.getvalue().strip()


def test_the_docs_tables_are_the_models_output():
    ar, moe = _run().split("\n\n")
    text = DOC.read_text()
    assert ar in text and moe in text


def test_a_faster_network_shortens_the_network_stage_only():
    base = {r[0]: r for r in multinode_model.all_reduce_rows(multinode_model.parse([]))}
    fast = {r[0]: r for r in multinode_model.all_reduce_rows(multinode_model.parse(["--net-gbs", "90"]))}
    assert fast["256 MiB"][1] == base["256 MiB"][1] and fast["256 MiB"][2] < base["256 MiB"][2]
