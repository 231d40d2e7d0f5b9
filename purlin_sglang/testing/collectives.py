"""Collective test cases for every engine's tests (CPU, the interpreter model, GPU): inputs, poisoned
outputs, bitwise comparison, and one call described as plain (picklable) data, checked against
:mod:`purlin_sglang.reference` (the one torch reference; its functions are re-exported here).

Reductions are DEFINED as: accumulate (16-bit floats in float32, everything else in its own
dtype) in rank order 0..n-1, then cast back. The reference does exactly that, so engine
results are compared bitwise.
"""

from __future__ import annotations

import torch

from ..engines.base import REDUCE_DTYPES  # noqa: F401 - re-exported for the tests
from ..reference import (  # noqa: F401 - re-exported for the tests
    all_gather, all_gather_v, all_reduce, all_to_all, all_to_all_v, broadcast, reduce_ref, reduce_scatter,
    reduce_scatter_v, scatter,
)

COPY_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
)
OPS = ("sum", "max", "min")


def make_input(seed: int, rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Fresh random, nonzero-valued input of rank ``rank`` (the same in every process for the same seed)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank * 7919 + 1)
    shape = tuple(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    if dtype.is_floating_point:
        v = torch.randn(shape, generator=g, dtype=torch.float64) * 3
        return torch.where(v == 0, torch.ones_like(v), v).to(dtype)
    lo, hi = (0, 255) if dtype is torch.uint8 else (-100, 100)
    v = torch.randint(lo, hi, shape, generator=g, dtype=torch.int64)
    return torch.where(v == 0, torch.full_like(v, 7), v).to(dtype)


def poison_like(expected: torch.Tensor) -> torch.Tensor:
    """An output buffer whose every element differs from ``expected`` (NaN for floating types)."""
    if expected.dtype is torch.bool:
        return ~expected
    if expected.dtype.is_floating_point or expected.dtype.is_complex:
        return torch.full_like(expected, float("nan"))
    p = expected.clone()
    p.reshape(-1).view(torch.uint8).bitwise_xor_(0xFF)
    return p


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if bits(got) != bits(want):
        bad = (got != want).nonzero()[:5].tolist() if got.numel() else []
        raise AssertionError(f"{what}: results differ bitwise (first differing indices {bad})\n"
                             f"got  {got.reshape(-1)[:8]}\nwant {want.reshape(-1)[:8]}")


# -- cases: one collective call described as plain (picklable) data ------------------------------
COLLECTIVES = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v", "reduce_scatter_v",
    "all_to_all_v", "broadcast", "gather", "reduce", "scatter",
)
REDUCING = ("all_reduce", "reduce_scatter", "reduce_scatter_v", "reduce")
ROOTED = ("broadcast", "gather", "reduce", "scatter")


FIXED = tuple(c for c in COLLECTIVES if not c.endswith("_v"))  # the non-V collectives, user specs included
PACKET_FORMS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v", "reduce_scatter_v",
                "broadcast", "gather", "reduce", "scatter")  # snac.has_packet_form: fixed forms, unrooted V forms


def user_spec(name: str):
    from purlin_sglang.collectives import COPY, PACKED, REDUCE, SCATTERED, CollectiveSpec

    return {
        "gather": CollectiveSpec("gather", PACKED, SCATTERED.root(), COPY),
        "reduce": CollectiveSpec("reduce", PACKED, PACKED.root(), REDUCE),
        "scatter": CollectiveSpec("scatter", SCATTERED.root(), PACKED, COPY),
    }[name]


def v_sizes(world: int, salt: int) -> list[int]:
    """Per-rank row counts with zeros among them (for world >= 2)."""
    return [((p + salt) * 5 + 2) % 4 for p in range(world)]


def v_matrix(world: int, salt: int) -> list[list[int]]:
    """send[p][q]: rows rank p sends to rank q, zeros included."""
    return [[((p * world + q + salt) * 5 + 2) % 4 for q in range(world)] for p in range(world)]


def case(coll: str, dtype=torch.float32, rows: int = 3, width: int = 5, op: str | None = None,
         seed: int = 0, root: int = 0, salt: int = 0, vrows: int = 1) -> dict:
    """``rows``: rows per rank slice for sliced inputs (so the call is always valid), else rows of x.
    V forms: ``v_sizes`` / ``v_matrix`` of ``salt``, each count times ``vrows`` (0: a call that moves
    nothing on any rank)."""
    if op is None and coll in REDUCING:
        op = "sum"
    return dict(coll=coll, dtype=dtype, rows=rows, width=width, op=op, seed=seed, root=root, salt=salt,
                vrows=vrows)


def _vs(c: dict, world: int) -> list[int]:
    """A V case's per-rank row counts (all_gather_v, reduce_scatter_v)."""
    return [n * c.get("vrows", 1) for n in v_sizes(world, c["salt"])]


def _vm(c: dict, world: int) -> list[list[int]]:
    """An all_to_all_v case's send matrix."""
    return [[n * c.get("vrows", 1) for n in row] for row in v_matrix(world, c["salt"])]


def _shape(c: dict, rows: int):
    return (rows,) if c["width"] is None else (rows, c["width"])


def case_inputs(c: dict, world: int) -> list[torch.Tensor]:
    coll, rows = c["coll"], c["rows"]
    if coll in ("reduce_scatter", "all_to_all", "scatter"):
        per = [rows * world] * world
    elif coll == "all_gather_v":
        per = _vs(c, world)
    elif coll == "reduce_scatter_v":
        per = [sum(_vs(c, world))] * world
    elif coll == "all_to_all_v":
        per = [sum(row) for row in _vm(c, world)]
    else:
        per = [rows] * world
    return [make_input(c["seed"], p, _shape(c, per[p]), c["dtype"]) for p in range(world)]


def case_expected(c: dict, world: int, r: int, xs) -> tuple[torch.Tensor, bool]:
    """(the reference result for rank r, whether rank r's output is written at all)."""
    coll, op, root = c["coll"], c["op"], c["root"]
    if coll == "all_reduce":
        return all_reduce(xs, r, op), True
    if coll == "all_gather":
        return all_gather(xs, r), True
    if coll == "reduce_scatter":
        return reduce_scatter(xs, r, op), True
    if coll == "all_to_all":
        return all_to_all(xs, r), True
    if coll == "all_gather_v":
        return all_gather_v(xs, r), True
    if coll == "reduce_scatter_v":
        return reduce_scatter_v(xs, r, _vs(c, world), op), True
    if coll == "all_to_all_v":
        return all_to_all_v(xs, r, _vm(c, world)), True
    if coll == "broadcast":
        return broadcast(xs, r, root), True
    if coll == "gather":
        return all_gather(xs, r), r == root
    if coll == "reduce":
        return reduce_ref(xs, op), r == root
    if coll == "scatter":
        return scatter(xs, r, root), True
    raise ValueError(coll)


def case_call(comm, c: dict, x: torch.Tensor, out):
    coll, op, root, world, r = c["coll"], c["op"], c["root"], comm.world_size, comm.rank
    if coll == "all_reduce":
        return comm.all_reduce(x, op, out=out)
    if coll == "all_gather":
        return comm.all_gather(x, out=out)
    if coll == "reduce_scatter":
        return comm.reduce_scatter(x, op, out=out)
    if coll == "all_to_all":
        return comm.all_to_all(x, out=out)
    if coll == "all_gather_v":
        return comm.all_gather_v(x, _vs(c, world), out=out)
    if coll == "reduce_scatter_v":
        return comm.reduce_scatter_v(x, _vs(c, world), op, out=out)
    if coll == "all_to_all_v":
        m = _vm(c, world)
        return comm.all_to_all_v(x, m[r], [m[p][r] for p in range(world)], out=out)
    if coll == "broadcast":
        return comm.broadcast(x, root, out=out)
    if coll in ("gather", "scatter"):
        return comm.run(user_spec(coll), x, out=out, root=root)
    if coll == "reduce":
        return comm.run(user_spec(coll), x, out=out, op=op, root=root)
    raise ValueError(coll)


def check_case(comm, c: dict, *, paths=("out", "default", "inplace")) -> dict:
    """Run ``c`` on ``comm`` through each output path and check it bitwise; returns rank r's results.

    Collective: every rank must call it with the same ``c`` and ``paths``.
    """
    world, r = comm.world_size, comm.rank
    xs = case_inputs(c, world)
    want, touched = case_expected(c, world, r, xs)
    what = f"rank {r} of {world}: {c['coll']} {c['dtype']} op={c['op']} rows={c['rows']} width={c['width']}"
    got = {}
    if "out" in paths:
        x = xs[r].clone()
        out = poison_like(want)
        res = case_call(comm, c, x, out)
        assert res is out, f"{what}: out= path did not return out"
        assert_bits_equal(out, want if touched else poison_like(want), what + " (out=)")
        assert_bits_equal(x, xs[r], what + " (input must be left unchanged)")
        got["out"] = out
    if "default" in paths:
        x = xs[r].clone()
        res = case_call(comm, c, x, None)
        if touched:
            assert_bits_equal(res, want, what + " (default out)")
        else:
            assert res.dtype == want.dtype and res.shape == want.shape, what
        if c["coll"] == "broadcast":
            assert res is x, f"{what}: broadcast without out= must run in place into x"
        else:
            assert res is not x, what
            assert_bits_equal(x, xs[r], what + " (input must be left unchanged)")
        got["default"] = res
    if "inplace" in paths and c["coll"] in ("all_reduce", "broadcast"):
        x = xs[r].clone()
        res = case_call(comm, c, x, x)
        assert res is x, what
        assert_bits_equal(x, want, what + " (in place)")
        got["inplace"] = x
    return got


def packet_cases(seed: int, *, staged: bool = True, large: bool = False) -> list[dict]:
    """Every non-V collective (the rooted ones too) at 0 bytes, 1 element, odd byte counts and a full
    256 KiB receive window per push (``rows`` is per slice for sliced inputs); ``staged``: V calls
    interleaved (all_to_all_v stays staged; all_gather_v and reduce_scatter_v take packets like the
    fixed forms); ``large``: and,
    midway, two payloads past a window (``auto`` stages them; forced packets refuse them)."""
    cases = []
    for i, coll in enumerate(FIXED):
        red = coll in REDUCING
        sizes = [(torch.float32, 0, 4, "sum"),
                 (torch.float16 if red else torch.int8, 1, None, "max"),  # 2 bytes / 1 byte
                 (torch.bfloat16 if red else torch.uint8, 3, 5, "min"),  # 30 / 15 bytes
                 (torch.float16 if red else torch.int16, 33, 65, "sum"),  # 4290 bytes
                 (torch.float32, 16, 4096, "max")]  # 262144 bytes: a full window (snac.policy)
        cases += [case(coll, dt, rows=rows, width=width, op=op if red else None, seed=seed + 10 * i + j,
                       root=(seed + j) % 2, salt=j) for j, (dt, rows, width, op) in enumerate(sizes)]
    if staged:
        extra = [case(coll, torch.float32, rows=3, width=7, seed=seed + 100 + i, salt=i)
                 for i, coll in enumerate(c for c in COLLECTIVES if c.endswith("_v"))]
        cases = [c for pair in zip(cases, extra * len(cases)) for c in pair]
    if large:
        half = len(cases) // 2
        cases[half:half] = [case("all_reduce", torch.float32, rows=1024, width=80, seed=seed + 200),
                            case("all_gather", torch.bfloat16, rows=1024, width=129, seed=seed + 201)]
    return cases


def rooted_packet_cases(seed: int, world: int) -> list[dict]:
    """The rooted collectives back to back, the root moving through every rank, payloads of 0 bytes to
    a few KiB, a packet all_reduce every third call. A rank's third packet call rewrites the window
    parity of its first, which is safe only because every pair of ranks the naming leaves silent
    exchanges one empty packet per call (snac/planner.py: Beat, Hear)."""
    out = []
    for i in range(2 * world + 2):
        coll = ROOTED[i % len(ROOTED)]
        red = coll in REDUCING
        out.append(case(coll, torch.bfloat16 if red else torch.float32, rows=(0, 1, 7, 40)[i % 4], width=33,
                        op="sum" if red else None, seed=seed + i, root=(3 * i + 1) % world, salt=i))
        if i % 3 == 2:
            out.append(case("all_reduce", torch.float32, rows=2, width=5, seed=seed + 100 + i))
    return out


def hybrid_cases(seed: int) -> list[dict]:
    """all_to_all_v as hybrid calls, for ``tuning.packet_max_bytes`` = 200: pairs of 0, 96, 192 (packets)
    and 288 bytes (staged) in one call (float32 rows of 8: 32 bytes; ``v_matrix`` counts 0-3 times
    ``vrows`` 3), calls whose pairs are all small (``vrows`` 1) or all large (``vrows`` 40: 5120 bytes
    and up, past a 16 KiB staging chunk), one that moves nothing on any rank (``vrows`` 0), bf16 and
    int8 rows, with a packet all_reduce and a staged all_gather in between."""
    out = []
    for i in range(2):
        s = seed + 10 * i
        out += [case("all_to_all_v", torch.float32, width=8, seed=s, salt=i, vrows=3),
                case("all_to_all_v", torch.bfloat16, width=9, seed=s + 1, salt=i + 1, vrows=1),
                case("all_reduce", torch.float32, rows=2, width=5, seed=s + 2),
                case("all_to_all_v", torch.float32, width=32, seed=s + 3, salt=i + 2, vrows=40),
                case("all_to_all_v", torch.int8, width=40, seed=s + 4, salt=i, vrows=2),
                case("all_gather", torch.float32, rows=64, width=64, seed=s + 5),
                case("all_to_all_v", torch.float32, width=3, seed=s + 6, salt=i, vrows=0),
                case("all_to_all_v", torch.float32, width=8, seed=s + 7, salt=i + 3, vrows=3)]
    return out


def v_packet_cases(seed: int) -> list[dict]:
    """all_gather_v and reduce_scatter_v as packet calls: empty slices among the sizes, calls empty on
    every rank (``vrows=0``), a largest push of 252 KiB (a window holds 256 KiB: packets only with
    ``tuning.packet_max_bytes`` raised), a fixed all_reduce and a staged all_to_all_v in between."""
    out = []
    for i in range(2):
        s = seed + 10 * i
        out += [case("all_gather_v", torch.float32, width=7, seed=s, salt=i),
                case("reduce_scatter_v", torch.bfloat16, width=33, op="max", seed=s + 1, salt=i + 1),
                case("all_gather_v", torch.int16, width=3, seed=s + 2, salt=i, vrows=0),
                case("all_reduce", torch.float32, rows=2, width=5, seed=s + 3),
                case("reduce_scatter_v", torch.float32, width=5, seed=s + 4, salt=i, vrows=0),
                case("all_to_all_v", torch.float32, width=3, seed=s + 5, salt=i),
                case("all_gather_v", torch.float32, width=1024, seed=s + 6, salt=i + 2, vrows=21),
                case("reduce_scatter_v", torch.float16, width=2048, op="sum", seed=s + 7, salt=i, vrows=21)]
    return out


def heap_cases(seed: int) -> list[dict]:
    """Every collective with a packet form (so a direct form), twice: bf16 / float32 rows of 33 with
    max and sum, and single rows of 7 (int16 for the copies); the roots alternate."""
    out = []
    for i, coll in enumerate(PACKET_FORMS):
        red = coll in REDUCING
        out.append(case(coll, torch.bfloat16 if red else torch.float32, rows=5, width=33,
                        op="max" if red and i % 2 else None, seed=seed + i, root=i % 2, salt=i))
        out.append(case(coll, torch.float32 if red else torch.int16, rows=1, width=7, seed=seed + 50 + i,
                        root=(i + 1) % 2, salt=i + 1))
    return out


def heap_input(comm, xs: list) -> torch.Tensor:
    """This rank's input ``xs[rank]`` copied into a new tensor of the communicator's symmetric heap.

    Every rank allocates alike, so the tensors lie at the same heap offset: a V form's rows differ
    between ranks, so the largest is allocated and each rank gets a view of its own rows."""
    mine = xs[comm.rank]
    if mine.dim():
        rows = max(t.shape[0] for t in xs)
        x = comm.symmetric_empty((rows,) + tuple(mine.shape[1:]), mine.dtype)[: mine.shape[0]]
    else:
        x = comm.symmetric_empty((), mine.dtype)
    return x.copy_(mine)


def check_case_in_heap(comm, c: dict) -> torch.Tensor:
    """Run ``c`` with this rank's input in a new tensor of the communicator's symmetric heap
    (``Communicator.symmetric_empty``, :func:`heap_input`) and check the result bitwise, out= path,
    input unchanged. Returns rank r's output. Collective: every rank must call it with the same ``c``."""
    world, r = comm.world_size, comm.rank
    xs = case_inputs(c, world)
    want, touched = case_expected(c, world, r, xs)
    x = heap_input(comm, xs)
    out = poison_like(want)
    assert case_call(comm, c, x, out) is out
    what = f"rank {r} of {world}: {c['coll']} {c['dtype']} op={c['op']} (input in the symmetric heap)"
    assert_bits_equal(out, want if touched else poison_like(want), what)
    assert_bits_equal(x, xs[r], what + " (input must be left unchanged)")
    return out
