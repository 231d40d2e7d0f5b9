"""Pieces of the multi-process GPU test workers, shared by test_cuda_group.py and test_nvshmem_provider.py.

They run inside the ranks that ``purlin_sglang.testing.launch`` spawns (the spawned processes get
this process's ``sys.path``, where pytest put ``tests/gpu``).
"""

from __future__ import annotations


from purlin_sglang.testing.collectives import assert_bits_equal, case_call, case_expected, case_inputs, poison_like  # noqa: E402


def mismatches_vs_cpu(cuda, cpu, cases, rank: int, world: int) -> list[str]:
    """Run every case on ``cuda`` and on ``cpu`` (the oracle), outputs poisoned first; the failures.

    Collective: every rank calls it with the same cases. Each CUDA result must be the very ``out``
    tensor passed, bitwise the CPU engine's result, bitwise the torch reference where the
    collective writes this rank's output, and leave its input unchanged.
    """
    bad = []
    for c in cases:
        xs = case_inputs(c, world)
        want, touched = case_expected(c, world, rank, xs)
        ref = case_call(cpu, c, xs[rank].clone(), poison_like(want))
        x = xs[rank].to(cuda.device)
        out = poison_like(want).to(cuda.device)
        got = case_call(cuda, c, x, out)
        cuda.synchronize()
        label = f"{c['coll']} {c['dtype']} rows={c['rows']} op={c['op']}"
        try:
            assert got is out
            assert_bits_equal(out.cpu(), ref, f"rank {rank}: {label} cuda vs cpu")
            if touched:
                assert_bits_equal(out.cpu(), want, f"rank {rank}: {label} cuda vs torch reference")
            assert_bits_equal(x.cpu(), xs[rank], f"rank {rank}: {label} input changed")
        except AssertionError as e:
            bad.append(str(e))
    return bad
