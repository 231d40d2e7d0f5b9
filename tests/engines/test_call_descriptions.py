"""The call description code of mismatch messages (engines/base.py: call_info / describe_info)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from purlin_sglang.collectives.catalog import ALL_REDUCE, BROADCAST, CATALOG
from purlin_sglang.engines.base import DESC_DTYPES, DESC_OPS, call_info, describe_info, fold32, mismatch_message
from purlin_sglang.snac import make_plan


def _plan(spec, root=None, op=None):
    s = spec if op is None else spec.with_consume(spec.consume.with_op(op))
    return make_plan(s, 4, 1, root=root, nbytes=1024, staging_bytes=1 << 16)


def test_every_catalog_collective_has_a_code():
    assert set(DESC_OPS) == set(CATALOG)


@pytest.mark.parametrize("trial", range(20))
def test_a_code_says_what_the_call_was(trial):
    rng = random.Random()
    name = rng.choice(DESC_OPS)
    dtype = rng.choice(DESC_DTYPES)
    nbytes = rng.randrange(0, 1 << 31)
    info = call_info(name, dtype, nbytes)
    assert 0 <= info < 1 << 63  # fits an int64 word (the CPU ring, the device record)
    np.array([info], dtype=np.int64)
    assert describe_info(info) == f"{name}(dtype={str(dtype).replace('torch.', '')}, {nbytes} bytes in)"


def test_reduction_root_and_limits():
    assert describe_info(call_info("all_reduce", torch.float32, 16, _plan(ALL_REDUCE, op="max"))) == \
        "all_reduce(dtype=float32, op=max, 16 bytes in)"
    assert describe_info(call_info("all_reduce", torch.float32, 16, _plan(ALL_REDUCE))) == \
        "all_reduce(dtype=float32, 16 bytes in)"  # sum is the default: not named
    assert describe_info(call_info("broadcast", torch.bfloat16, 6, _plan(BROADCAST, root=3))) == \
        "broadcast(dtype=bfloat16, root=3, 6 bytes in)"
    assert describe_info(call_info("mine", torch.float32, 1 << 40)) == \
        "a collective of the user's naming(dtype=float32, 2147483647+ bytes in)"
    assert describe_info(call_info("all_gather", torch.complex32 if hasattr(torch, "complex32") else None, 8)) == \
        "all_gather(8 bytes in)"  # a dtype without a code is left out


def test_fold32_and_the_message():
    fp = random.getrandbits(63)
    assert 0 <= fold32(fp) < 1 << 32 and fold32(fp) == (fp ^ (fp >> 32)) & 0xFFFFFFFF
    msg = mismatch_message("all_reduce", 2, 5, 17, "A(x)", "B(y)")
    assert msg == ("all_reduce: rank 2 and rank 5 entered call #17 with different collectives, reductions, dtypes, "
                   "roots or sizes: rank 2 called A(x), rank 5 called B(y); every rank must make the same calls in "
                   "the same order")
