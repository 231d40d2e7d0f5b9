"""A model, not a measurement: the time of purlin's two-level plans on 2 nodes x 8 GPUs (docs/MULTINODE.md).

Each stage costs a fixed latency plus its bytes at a link's speed, stages one after another (the
plans do not overlap them). The inputs are the assumptions of docs/MULTINODE.md, each a flag:
a purlin stage inside a node (``--node-us`` plus bytes at ``--node-gbs``, one NVLink direction),
a torch.distributed stage between nodes (``--net-us`` plus bytes at ``--net-gbs``, one NIC per GPU),
the node-order reduction (``--reduce-us`` plus bytes at ``--hbm-gbs``). It prints the all_reduce
table and the MoE decode step (random routing, the two-hop dispatch and the slot-by-slot combine of
purlin_sglang.multinode.moe) as markdown. Usage::

    python -m purlin_sglang.bench.multinode_model [--nodes 2 --per-node 8 ...]
"""

from __future__ import annotations

import argparse


def all_reduce_rows(a) -> list[tuple]:
    """(size label, node us, network us, reduction us, total us, busbw GB/s, flat-ring network us)."""
    n, size = a.nodes, a.per_node
    w = n * size
    rows = []
    for label, s in (("16 KiB", 16 << 10), ("256 KiB", 256 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20),
                     ("256 MiB", 256 << 20)):
        node = 2 * (a.node_us + (size - 1) / size * s / (a.node_gbs * 1e3))  # reduce-scatter + all-gather inside
        net = a.net_us + (n - 1) * (s / size) / (a.net_gbs * 1e3)  # all-gather of the shard's node partials
        red = a.reduce_us + (n + 1) * (s / size) / (a.hbm_gbs * 1e3)  # read N partials, write one
        total = node + net + red
        ring = 2 * (w - 1) / w * (s / size) / (a.net_gbs * 1e3)  # a flat ring's network bytes per NIC
        rows.append((label, node, net, red, total, s / total / 1e3 * 2 * (w - 1) / w, ring))
    return rows


def moe_rows(a) -> list[tuple]:
    """(step, bf16 us, fp8 us) of one decode step's dispatch and combine."""
    n, size, t, h, k = a.nodes, a.per_node, a.tokens, a.hidden, a.topk
    w = n * size
    p_node = 1 - (1 - 1 / n) ** k  # a token has a slot on a given node
    hit = 1 - (1 - 1 / w) ** k  # a token has a slot on a given rank
    ranks_per_node = size * hit / p_node  # distinct ranks of a node a token reaches, given it reaches the node
    hdr1, hdr2, back_hdr = 8 * (3 * k + 2), 8 * (2 * k + 2), 8
    two_level_gather = a.net_us + a.node_us  # a small two-level all_gather (counts, statuses, splits)

    def net(b):
        return a.net_us + b / (a.net_gbs * 1e3)

    def node(b):
        return a.node_us + b / (a.node_gbs * 1e3)

    out = []
    for label, row in (("bf16", 2 * h), ("fp8", h)):
        crossing = t * p_node * (n - 1) * (row + hdr1)  # bytes one rank sends to the other nodes
        relay_tokens = t * p_node * n  # tokens a relay fans out: its peers' and its own
        inside = relay_tokens * ranks_per_node * (size - 1) / size * (row + hdr2)
        out.append((label, two_level_gather, net(0), net(crossing), node(inside)))
    rows = [("dispatch: count exchange (two-level all_gather)", out[0][1], out[1][1]),
            ("dispatch: tokens per node across (counts first)", out[0][2] + out[0][3], out[1][2] + out[1][3]),
            ("dispatch: relay to the node's ranks", out[0][4], out[1][4])]
    rows.append(("**dispatch**", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    slot = 2 * h + back_hdr  # bf16 expert rows back, one per (token, slot)
    back_inside = t * k * (size - 1) / size * slot
    back_across = t * k * (n - 1) / n * slot
    combine = [("combine: status and splits (two two-level all_gathers)", 2 * two_level_gather),
               ("combine: slot rows inside the node", node(back_inside)),
               ("combine: slot rows across", net(back_across)),
               ("combine: k-order reduction", a.reduce_us + t * k * 2 * h / (a.hbm_gbs * 1e3))]
    combine.append(("**combine**", sum(r[1] for r in combine)))
    return rows + [(name, us, None) for name, us in combine]


def parse(argv=None) -> argparse.Namespace:
    """The assumptions (defaults: docs/MULTINODE.md's) from the command line ``argv``."""
    p = argparse.ArgumentParser(prog="python -m purlin_sglang.bench.multinode_model",
                                description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--node-us", type=float, default=8.0)
    p.add_argument("--node-gbs", type=float, default=370.0)
    p.add_argument("--net-us", type=float, default=15.0)
    p.add_argument("--net-gbs", type=float, default=45.0)
    p.add_argument("--reduce-us", type=float, default=3.0)
    p.add_argument("--hbm-gbs", type=float, default=3000.0)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    print("| all_reduce size | node stages | network stage | reduction | total | busbw | flat ring, network only |")
    print("|---|---|---|---|---|---|---|")
    for label, node, net, red, total, busbw, ring in all_reduce_rows(a):
        print(f"| {label} | {node:.1f} us | {net:.1f} us | {red:.1f} us | {total:.0f} us | {busbw:.1f} GB/s | "
              f"{ring:.1f} us |")
    print()
    print("| MoE decode step | bf16 rows | FP8 rows |")
    print("|---|---|---|")
    for name, bf16, fp8 in moe_rows(a):
        print(f"| {name} | {bf16:.0f} us | {'(bf16 rows back)' if fp8 is None else f'{fp8:.0f} us'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
