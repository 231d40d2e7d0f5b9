"""Define a collective by naming it, print its SNAC plan, and run it on 4 virtual ranks.

    python examples/custom_collective.py
"""

import torch

import purlin_sglang as ps
from purlin_sglang.collectives import COPY, PACKED, SCATTERED, CollectiveSpec
from purlin_sglang.snac import make_plan

# Gather to a root: every rank's packed input lands in slice p of the root's output.
GATHER = CollectiveSpec("gather", PACKED, SCATTERED.root(), COPY)

print(make_plan(GATHER, world=4, rank=1, root=0, staging_bytes=1 << 20).describe())
print()
print(make_plan(GATHER, world=4, rank=0, root=0, staging_bytes=1 << 20).describe())


def step(comm: ps.Communicator):
    x = torch.full((2, 3), float(comm.rank + 1))
    return comm.run(GATHER, x, root=0)


out = ps.run_virtual(4, step)
print("\nroot's output:\n", out[0])
expected = torch.cat([torch.full((2, 3), float(r + 1)) for r in range(4)])
if not torch.equal(out[0], expected):
    raise SystemExit("gather gave a wrong result")
print("gather is correct")
