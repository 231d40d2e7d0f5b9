"""The MoE exchange of a group that spans nodes: the CPU engine's MoE steps (:mod:`purlin_sglang.moe.cpu`)
over the two-level collectives, with a two-hop PutRows that sends each token across nodes once per
destination node.

Dispatch: the count exchange (a two-level all_gather: every rank raises alike for a bad call or a
capacity overflow), then

1. across nodes: each token once per destination node m, to the rank of m with the sender's local
   index (the relay), with a header naming every slot of the token that lands on m (its rank, local
   expert and index); the relays learn how many rows come from each node first (N words);
2. inside the node: the relay sends each token once per destination rank of its node (purlin's
   all_to_all_v), with the CPU engine's row header;
3. Expand, as on one node: a row's slot is fixed by the count matrix, so the result is bitwise the
   one-node result (the order of arrival does not matter).

Combine: every (token, slot) row goes back to its source over the two-level all_to_all_v and is
reduced there in the fixed k order, so it is bitwise the one-node result too. (Pre-reducing a
token's slots of one node on the relay would cross the nodes once per token and node, but with a
different association of the sum: not done.) Blocks the host (row counts are read there), so it is
not capturable in a CUDA graph; on CUDA its steps are torch device ops.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PurlinUnavailableError, PurlinValueError
from ..moe import cpu
from ..moe.engine import MoEContext
from ..moe.validate import check_id_range
from .cross import CrossFailure


def make_moe(comm: Any) -> Any:
    """The MoE part of a multi-node communicator: :class:`NodeMoE` (eager; on CUDA its steps are torch
    device ops with the counts read on the host, so it is not capturable)."""
    ctx = MoEContext(rank=comm.rank, world=comm.world_size, device=comm.device, config=comm.config, owner=id(comm),
                     all_gather=comm.all_gather, all_to_all_v=comm.all_to_all_v,
                     mark_broken=lambda why: None, group=comm.group)
    return NodeMoE(ctx, comm)


class NodeMoE(cpu.CpuMoE):
    """:class:`~purlin_sglang.moe.cpu.CpuMoE` with the two-hop PutRows of the module docstring."""

    def __init__(self, ctx: MoEContext, comm: Any):
        super().__init__(ctx)
        self.comm = comm
        self.rows_across = 0  # tokens the last dispatch sent to other nodes (each once per destination node)

    def dispatch(self, x, ids, weights, num_experts: int, capacity, quant: str, capturing: bool, max_tokens=None):
        if capturing:  # the same on every rank (each captures the same calls): every rank raises
            raise PurlinUnavailableError(
                "moe_dispatch: the MoE exchange across nodes reads its row counts on the host and cannot be "
                "captured in a CUDA graph; run it eagerly")
        if ids.device.type == "cuda" and ids.numel():  # the CPU engine's checks ran; the id range too
            try:
                check_id_range(int(ids.min()), int(ids.max()), num_experts)
            except PurlinValueError as e:
                self.reject(e)  # every rank raises (this one its own error)
        plan = self._plan("dispatch", num_experts, capacity, quant)
        return cpu.dispatch(self.ctx, self.exchange, plan, x, ids, weights, put=self._put)

    def _put(self, ctx: MoEContext, routed: cpu.Routed) -> tuple[torch.Tensor, torch.Tensor]:
        comm = self.comm
        lay, n, size = comm.layout, comm.layout.count, comm.layout.local_size
        me, m_me = comm.rank, comm._node_index
        r, payload = routed.r, routed.payload
        t_n, k_n = r.dst.shape
        dev = payload.device
        node_of = torch.tensor([lay.place(d)[0] for d in range(comm.world_size)] + [n], dtype=torch.int64,
                               device=dev)
        dnode = node_of[torch.where(r.dst >= 0, r.dst, comm.world_size)]  # [T, K]; n for skipped slots
        to_node = torch.zeros(t_n, n + 1, dtype=torch.bool, device=dev)
        to_node[torch.arange(t_n, device=dev)[:, None].expand(t_n, k_n), dnode] = True
        pairs = to_node[:, :n].t().nonzero()  # (m, t), m-major then t
        m_of, t_of = pairs[:, 0], pairs[:, 1]
        on_m = dnode[t_of] == m_of[:, None]
        header = torch.cat([t_of[:, None], torch.where(on_m, r.dst[t_of], -1), torch.where(on_m, r.le[t_of], -1),
                            torch.where(on_m, r.j[t_of], -1), cpu.scale_words(routed.scales, t_of)], 1)
        hop1 = cpu.pack(header, cpu.token_rows(payload, t_of))
        send = torch.bincount(m_of, minlength=n)[:n]
        self.rows_across = int(send.sum()) - int(send[m_me])
        try:
            recv = comm.link.all_to_all(send.view(n, 1), [1] * n, [1] * n).view(-1).tolist()
            got = comm.link.all_to_all(hop1.contiguous(), send.tolist(), recv)
        except CrossFailure as e:
            raise comm._cross_failed("moe_dispatch", e) from e
        # on the relay: each token once per destination rank of this node, with the one-node header
        w1 = 3 * k_n + 2
        h1 = cpu.header_of(got, w1)
        b1 = got[:, 8 * w1:]
        dst1, le1, j1 = h1[:, 1:1 + k_n], h1[:, 1 + k_n:1 + 2 * k_n], h1[:, 1 + 2 * k_n:1 + 3 * k_n]
        rows, counts = [], []
        for jj in range(size):
            d = lay.rank_at(m_me, jj)
            hit = dst1 == d
            idx = hit.any(1).nonzero().view(-1)
            hdr = torch.cat([h1[idx, :1], torch.where(hit[idx], le1[idx], -1), torch.where(hit[idx], j1[idx], -1),
                             h1[idx, w1 - 1:]], 1)
            rows.append(cpu.pack(hdr, b1[idx]))
            counts.append(len(idx))
        # from relay jj: the tokens of sources (m, jj), m in node order, that come to me
        tokens = routed.tokens
        srcs = lay.local_major  # relay jj's sources: (m, jj), m in node order
        per_src = [int(tokens[p, me]) for p in srcs]
        from_relay = [sum(per_src[jj * n:(jj + 1) * n]) for jj in range(size)]
        out = comm.local.all_to_all_v(torch.cat(rows).contiguous(), counts, from_relay)
        src = torch.repeat_interleave(torch.tensor(srcs, dtype=torch.int64),
                                      torch.tensor(per_src, dtype=torch.int64)).to(dev)
        return out, src
