"""benchmarks/bench_moe_grid.py: the grid bound set for each bench moe run and restored (no GPU: a
stand-in for the CLI records what each run saw)."""

import importlib.util
from pathlib import Path

import pytest

import purlin_sglang.moe.cuda as moe_cuda

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("bench_moe_grid", ROOT / "benchmarks" / "bench_moe_grid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_run_sees_its_grid_bound_and_the_bound_is_restored(tmp_path):
    mod, seen = _module(), []
    before = moe_cuda.MAX_BLOCKS

    def fake_main(argv):
        seen.append((moe_cuda.MAX_BLOCKS, argv))
        return 1 if moe_cuda.MAX_BLOCKS == 2 else 0

    rc = mod.run([8, 2, 1], ["--tokens", "1"], tmp_path, main=fake_main)
    assert rc == 1 and moe_cuda.MAX_BLOCKS == before
    assert [b for b, _ in seen] == [8, 2, 1]
    assert seen[1][1] == ["bench", "moe", "--tokens", "1", "--out", str(tmp_path / "blocks-2")]


def test_the_bound_is_restored_when_a_run_raises(tmp_path):
    mod, before = _module(), moe_cuda.MAX_BLOCKS

    def boom(argv):
        raise RuntimeError("no GPU")

    with pytest.raises(RuntimeError):
        mod.run([3], [], tmp_path, main=boom)
    assert moe_cuda.MAX_BLOCKS == before


@pytest.mark.parametrize("argv", [["--blocks", "4,0"], ["--blocks", "a"], ["--blocks", "4", "--", "--out", "x"]])
def test_bad_command_lines_are_refused(argv):
    with pytest.raises(SystemExit):
        _module().parse(argv)


def test_the_words_after_the_separator_go_to_bench_moe():
    args, rest = _module().parse(["--blocks", "16,2", "--out", "d", "--", "--tokens", "1", "--no-reference"])
    assert args.blocks == [16, 2] and args.out == "d" and rest == ["--tokens", "1", "--no-reference"]
