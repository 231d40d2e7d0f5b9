"""MoE dispatch and combine on the CPU engine (virtual ranks) against the plain torch reference.

Fresh random routings per case: uneven token counts, ranks with no tokens, ids of -1, experts
nobody routes to, a token naming one expert twice; exact and capacity layouts, FP8 payloads,
three activation dtypes. Dispatch is compared bitwise (valid rows), combine bitwise with the
float32 k-order reference and within tolerance of the float64 one.
"""

import pytest
import torch

import purlin_sglang as ps
from _moe_cases import FP8, check_results, make_case, run_rank
from purlin_sglang.moe.reference import reference_dispatch
from purlin_sglang.moe.namings import MOE_COMBINE, MOE_DISPATCH
from purlin_sglang.moe.plan import make_moe_plan

CFG = {"staging_bytes": 1 << 16, "timeout_s": 20}


def run_case(world, experts, topk, hidden, dtype, seed, capacity=None, qdtype=None, max_tokens=9, out_dtype=None):
    xs, ids, ws = make_case(world, experts, topk, hidden, dtype, seed, max_tokens=max_tokens)
    if capacity == "fit":  # the smallest capacity that holds this routing
        capacity = max(1, max(int((i.to(torch.int64) == e).sum()) for i in ids for e in range(experts)))
    res = ps.run_virtual(world, lambda c: run_rank(c, xs, ids, ws, experts, capacity, qdtype, out_dtype), config=CFG)
    check_results(res, xs, ids, ws, experts, capacity=capacity, dtype=qdtype)
    return res


@pytest.mark.parametrize("world,experts,topk", [(1, 4, 2), (2, 4, 2), (3, 6, 3), (4, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_exact_random_routings(world, experts, topk, dtype):
    for seed in range(2):
        run_case(world, experts, topk, 33, dtype, seed * 7 + world)


@pytest.mark.parametrize("world", [2, 4])
def test_capacity_layout(world):
    res = run_case(world, 2 * world, 2, 4, torch.bfloat16, 3, capacity="fit")
    cap = res[0]["x"].shape[0] // (2 * world)
    for r in res:  # groups at e * world * capacity, compact, padding rows after with expert -1
        ex = r["expert"].view(2, world * cap)
        for e in range(2):
            n = int(r["counts"][e])
            assert (ex[e, :n] == e).all() and (ex[e, n:] == -1).all()


@pytest.mark.parametrize("capacity", [None, "fit"])
def test_fp8_payload(capacity):
    res = run_case(3, 6, 2, 16, torch.bfloat16, 11, capacity=capacity, qdtype=FP8)
    assert res[0]["x"].dtype == FP8 and res[0]["scales"].dtype == torch.float32
    assert res[0]["y"].dtype == torch.bfloat16


def test_combine_in_float32_from_bf16_rows():
    run_case(2, 4, 2, 6, torch.bfloat16, 5, out_dtype=torch.float32)


def test_all_slots_skipped_and_no_tokens():
    def fn(c):
        x = torch.randn(3 if c.rank == 0 else 0, 4)
        ids = torch.full((x.shape[0], 2), -1, dtype=torch.int64)
        d = c.moe_dispatch(x, ids, torch.ones(ids.shape), num_experts=4)
        y = c.moe_combine(d.x.clone(), d)
        return d.rows, d.counts.tolist(), y
    res = ps.run_virtual(2, fn, config=CFG)
    assert [r[0] for r in res] == [0, 0] and res[0][1] == [0, 0]
    assert torch.equal(res[0][2], torch.zeros(3, 4)) and res[1][2].shape == (0, 4)


def test_capacity_overflow_raises_and_communicator_stays_usable():
    xs, ids, ws = make_case(2, 4, 2, 3, torch.float32, 1, max_tokens=8, empty_rank=False)
    ids[1] = torch.full_like(ids[1], 2)  # rank 1 routes every slot to expert 2
    n = ids[1].numel()

    def fn(c):
        with pytest.raises(ps.PurlinCapacityError) as ei:
            run_rank(c, xs, ids, ws, 4, capacity=n - 1)
        e = ei.value
        assert (e.rank, e.expert, e.count) == (1, 2, n) and "rank 1" in str(e) and "expert 2" in str(e)
        return run_rank(c, xs, ids, ws, 4, capacity=n)  # then a good call on the same communicator
    res = ps.run_virtual(2, fn, config=CFG)
    check_results(res, xs, ids, ws, 4, capacity=n)


BAD = [
    ("x", lambda x, i, w: dict(x=x.to(torch.int32))),
    ("x", lambda x, i, w: dict(x=x[0])),
    ("topk_ids", lambda x, i, w: dict(topk_ids=i.float())),
    ("topk_ids", lambda x, i, w: dict(topk_ids=i[:1])),
    ("topk_ids", lambda x, i, w: dict(topk_ids=torch.full_like(i, 4))),
    ("topk_ids", lambda x, i, w: dict(topk_ids=torch.full_like(i, -2))),
    ("topk_weights", lambda x, i, w: dict(topk_weights=w[:, :1].contiguous())),
    ("topk_weights", lambda x, i, w: dict(topk_weights=i)),
    ("num_experts", lambda x, i, w: dict(num_experts=3)),
    ("num_experts", lambda x, i, w: dict(num_experts=0)),
    ("capacity", lambda x, i, w: dict(capacity=0)),
    ("dtype", lambda x, i, w: dict(dtype=torch.int8)),
]


def test_bad_arguments_name_the_argument_and_leave_the_communicator_usable():
    xs, ids, ws = make_case(2, 4, 2, 3, torch.float32, 2, empty_rank=False)

    def fn(c):
        r = c.rank
        for what, change in BAD:
            args = dict(x=xs[r], topk_ids=ids[r], topk_weights=ws[r], num_experts=4)
            args.update(change(xs[r], ids[r], ws[r]))
            with pytest.raises(ps.PurlinValueError, match=what):
                c.moe_dispatch(**args)
        d = c.moe_dispatch(xs[r], ids[r], ws[r], num_experts=4)
        for bad in (d.x[:, :1].contiguous(), d.x.to(torch.int32), torch.zeros(d.rows + 1, 3)):
            with pytest.raises(ps.PurlinValueError, match="expert_out"):
                c.moe_combine(bad, d)
        with pytest.raises(ps.PurlinValueError, match="MoEDispatch"):
            c.moe_combine(d.x, "d")
        c.moe_combine(d.x.clone(), d)
        return run_rank(c, xs, ids, ws, 4)
    res = ps.run_virtual(2, fn, config=CFG)
    check_results(res, xs, ids, ws, 4)


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_bad_arguments_on_one_rank_raise_on_every_rank_without_a_timeout(bad_rank):
    """One rank's bad call: it raises its own error (naming the argument), its peer raises naming that
    rank, at once (not at timeout_s), and the next call works on both. The good rank has no tokens."""
    import time

    xs, ids, ws = make_case(2, 4, 2, 3, torch.float32, 5, empty_rank=False)
    good, g = 1 - bad_rank, torch.Generator().manual_seed(6 + bad_rank)
    xs[good], ids[good], ws[good] = xs[good][:0], ids[good][:0], ws[good][:0]
    xs[bad_rank] = torch.randn(4, 3, generator=g)  # 4 tokens: every BAD change is bad here
    ids[bad_rank] = torch.randint(0, 4, (4, 2), generator=g)
    ws[bad_rank] = torch.rand(4, 2, generator=g)

    def fn(c):
        r = c.rank
        for what, change in BAD:
            args = dict(x=xs[r], topk_ids=ids[r], topk_weights=ws[r], num_experts=4)
            if r == bad_rank:
                args.update(change(xs[r], ids[r], ws[r]))
            t0 = time.monotonic()
            with pytest.raises(ps.PurlinValueError) as e:
                c.moe_dispatch(**args)
            assert time.monotonic() - t0 < 10, what
            assert what in str(e.value), (what, str(e.value))  # the peers quote the erring rank's message
            if r != bad_rank:
                assert isinstance(e.value, ps.PurlinRejectedError) and e.value.rank == bad_rank, repr(e.value)
                assert f"rank {bad_rank} rejected its arguments" in str(e.value) and what in e.value.cause
        return run_rank(c, xs, ids, ws, 4)
    res = ps.run_virtual(2, fn, config=CFG)
    check_results(res, xs, ids, ws, 4)


def test_hidden_size_mismatch_across_ranks_raises_on_every_rank():
    def fn(c):
        x = torch.randn(2, 3 + c.rank)
        ids = torch.zeros(2, 1, dtype=torch.int64)
        with pytest.raises(ps.PurlinValueError, match="hidden size"):
            c.moe_dispatch(x, ids, torch.ones(2, 1), num_experts=2)
        x = torch.randn(2, 3)
        d = c.moe_dispatch(x, ids, torch.ones(2, 1), num_experts=2)
        return c.moe_combine(d.x.clone(), d), x
    for y, x in ps.run_virtual(2, fn, config=CFG):
        assert torch.equal(y, x)


def test_dtype_mismatch_across_ranks_names_the_dtypes_on_every_rank():
    def fn(c):
        x = torch.randn(2, 4, dtype=(torch.float32, torch.bfloat16)[c.rank])
        ids = torch.zeros(2, 1, dtype=torch.int64)
        with pytest.raises(ps.PurlinValueError) as e:
            c.moe_dispatch(x, ids, torch.ones(2, 1), num_experts=2)
        return str(e.value)
    for msg in ps.run_virtual(2, fn, config=CFG):
        assert "disagree on x dtype: ['float32', 'bfloat16'] (rank order)" in msg, msg


def test_interleaved_with_collectives_and_repeated_calls():
    xs, ids, ws = make_case(3, 6, 2, 4, torch.float32, 9)

    def fn(c):
        a = c.all_reduce(torch.ones(5))
        first = run_rank(c, xs, ids, ws, 6)
        d = c.moe_dispatch(xs[c.rank], ids[c.rank], ws[c.rank], num_experts=6)  # dispatch twice in a row
        again = run_rank(c, xs, ids, ws, 6)
        return a, first, again, d.rows
    res = ps.run_virtual(3, fn, config=CFG)
    assert all(torch.equal(r[0], torch.full((5,), 3.0)) for r in res)
    check_results([r[1] for r in res], xs, ids, ws, 6)
    check_results([r[2] for r in res], xs, ids, ws, 6)


def test_plans_are_printable_data_and_namings_are_routed():
    assert str(MOE_DISPATCH) == "moe_dispatch: routed -> transposedV, copy"
    assert str(MOE_COMBINE) == "moe_combine: transposedV -> routed, weighted_reduce(sum)"
    p = make_moe_plan(MOE_DISPATCH, 8, 2, 256, capacity=128, quant="fp8")
    assert p.expert_range == (64, 96) and [s.kind for s in p.steps] == [
        "route", "count_exchange", "put_rows", "wait", "expand"]
    assert "capacity 128" in str(p)
    c = make_moe_plan(MOE_COMBINE, 8, 2, 256)
    assert [s.kind for s in c.steps] == ["put_back", "notify", "wait", "weighted_reduce"]
    with pytest.raises(ps.PurlinValueError, match="num_experts"):
        make_moe_plan(MOE_DISPATCH, 3, 0, 4)
    with pytest.raises(ps.PurlinPlanError):
        ps.CollectiveSpec("bad", MOE_DISPATCH.input, MOE_DISPATCH.input)


def test_reference_raises_on_overflow_and_orders_rows():
    x = [torch.arange(6.0).view(3, 2), torch.arange(6.0, 10.0).view(2, 2)]
    ids = [torch.tensor([[1, 0], [1, -1], [0, 1]]), torch.tensor([[1, 1], [-1, 0]])]
    ws = [torch.ones(3, 2), torch.ones(2, 2)]
    d = reference_dispatch(x, ids, ws, 2, 2)
    # rank 1 owns expert 1: rows from rank 0 tokens 0, 1, 2 then rank 1 token 0 slots 0 and 1
    assert d[1].src_rank.tolist() == [0, 0, 0, 1, 1] and d[1].src_slot.tolist() == [0, 2, 5, 0, 1]
    assert d[0].src_slot.tolist() == [1, 4, 3]
    with pytest.raises(ValueError, match="rank 0 routes 2 rows to expert 0"):
        reference_dispatch(x, ids, ws, 2, 2, capacity=1)


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_bad_combine_on_one_rank_raises_on_every_rank_without_a_timeout(bad_rank):
    """One rank's combine arguments are bad (the wrong shape, the wrong dtype, a foreign MoEDispatch): it raises
    its own error, its peer raises naming it, at once (not at timeout_s), and the next pair works on both."""
    import time

    xs, ids, ws = make_case(2, 4, 2, 3, torch.float32, 8, empty_rank=False)
    bad = (("expected", lambda out, d: (out[1:], d)), ("dtype", lambda out, d: (out.to(torch.int32), d)),
           ("MoEDispatch", lambda out, d: (out, "not a dispatch")))

    def fn(c):
        r = c.rank
        for what, change in bad:
            d = c.moe_dispatch(xs[r], ids[r], ws[r], num_experts=4)
            out = d.x.clone()
            args = change(out, d) if r == bad_rank else (out, d)
            t0 = time.monotonic()
            with pytest.raises(ps.PurlinValueError) as e:
                c.moe_combine(*args)
            assert time.monotonic() - t0 < 10, what
            assert what in str(e.value), (what, str(e.value))  # the peers quote the erring rank's message
            if r != bad_rank:
                assert isinstance(e.value, ps.PurlinRejectedError) and e.value.rank == bad_rank, repr(e.value)
                assert f"rank {bad_rank} rejected its arguments" in str(e.value) and what in e.value.cause
        return run_rank(c, xs, ids, ws, 4)
    res = ps.run_virtual(2, fn, config={**CFG, "timeout_s": 30})
    check_results(res, xs, ids, ws, 4)
