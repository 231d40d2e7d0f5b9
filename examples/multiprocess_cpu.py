"""Collectives across processes on one host: a gloo group for set-up, shared memory for data.

    python examples/multiprocess_cpu.py [world_size]
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import purlin_sglang as ps


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with ps.Communicator(dist.group.WORLD, "cpu", config={"timeout_s": 30}) as comm:
            x = torch.randn(1000, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rank))
            y = comm.all_reduce(x)
            parts = [torch.randn(1000, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(r))
                     for r in range(world)]
            acc = parts[0].float()
            for p in parts[1:]:
                acc = acc + p.float()
            ok = torch.equal(y, acc.bfloat16())
            g = comm.all_gather(x)
            ok = ok and torch.equal(g, torch.cat(parts))
            print(f"rank {rank}: all_reduce and all_gather {'correct' if ok else 'WRONG'}", flush=True)
            if not ok:
                raise SystemExit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port), nprocs=world, join=True)
