"""Inputs in the symmetric heap: the peers read them in place (the direct plans), no staging copy.

    python examples/symmetric_heap.py [world] [--device cuda]

Every rank allocates the same tensors in the same order from ``comm.symmetric_empty`` (config
``symmetric_bytes``), so each lies at the same offset of every rank's heap. A collective whose input
is such a tensor reads its peers' inputs where they lie; the same call on an ordinary tensor stages
them. The script prints both plans for one rank and checks both results against each other.
"""

import sys

import torch

import purlin_sglang as ps
from purlin_sglang.collectives import CATALOG

world = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4
device = "cuda" if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cuda" else "cpu"
config = {"staging_bytes": 1 << 20, "symmetric_bytes": 16 << 20}


def plan_of(comm, x, op="sum"):
    """The plan the call cache holds for comm.all_reduce(x) (after the call)."""
    return comm._path.lookup(CATALOG["all_reduce"], x, None, op, None, None, None)[0].sched.plan


def step(comm: ps.Communicator):
    n = 1 << 16
    heap_x = comm.symmetric_empty(n, torch.float32)  # the same offset on every rank
    plain_x = torch.empty(n, device=comm.device)
    data = torch.arange(n, dtype=torch.float32, device=comm.device) % 251 * (comm.rank + 1)
    heap_x.copy_(data)
    plain_x.copy_(data)
    a = comm.all_reduce(heap_x)  # direct: the peers' heap_x read in place
    b = comm.all_reduce(plain_x)  # staged one-shot
    comm.synchronize()
    if comm.rank == 1:
        print(plan_of(comm, heap_x).describe(), "\n")
        print(plan_of(comm, plain_x).describe(), "\n")
    return torch.equal(a, b), plan_of(comm, heap_x).algorithm, plan_of(comm, plain_x).algorithm


results = ps.run_virtual(world, step, device=device, config=config)
print(results)
if not all(same for same, _, _ in results) or {r[1] for r in results} != {"direct"}:
    raise SystemExit("the direct all_reduce differs from the staged one, or did not run direct")
print(f"direct and staged all_reduce agree bitwise on {world} ranks")
