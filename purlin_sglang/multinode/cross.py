"""The stage between nodes: copies among the N ranks of one local index, on torch.distributed.

:class:`CrossLink` holds the two groups a rank of a multi-node communicator needs: ``local`` (its
node's ranks; a gloo group, for purlin's set-up) and ``cross`` (the ranks of its local index on
every node, in node order; the inter-node backend). Every operation here is a copy of bytes
(reductions happen on the receiving rank, in a fixed order), so any backend moves any dtype.
Collective over the cross group; capturable in a CUDA graph where the backend is (NCCL).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Sequence

import torch

from ..errors import PurlinTopologyError
from .layout import NodeLayout


def backend_for(setting: str, device: torch.device, layout: NodeLayout) -> str:
    """The torch.distributed backend between nodes for config ``topology.inter_node`` = ``setting``,
    or a PurlinTopologyError naming the nodes where the group cannot run across them."""
    import torch.distributed as dist

    where = f"the group spans {layout.count} nodes ({layout.describe()}; from {layout.source})"
    if setting == "off":
        raise PurlinTopologyError(
            f"Communicator: {where} and topology.inter_node is 'off': make one Communicator per node, or set "
            "topology.inter_node to 'auto' to run the group's collectives in two levels (docs/MULTINODE.md)")
    if not layout.regular:
        raise PurlinTopologyError(
            f"Communicator: {where}; the nodes hold different numbers of the group's ranks, and the two-level "
            "plans need the same number on every node (docs/MULTINODE.md)")
    backend = setting if setting != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    available = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available}[backend]()
    if not available:
        raise PurlinTopologyError(f"Communicator: {where}, and torch.distributed has no {backend} backend here to "
                                  "join them (topology.inter_node)")
    return backend  # gloo with CUDA tensors copies through host memory: for tests of several ranks on one GPU


def make_groups(group: Any, layout: NodeLayout, rank: int, backend: str,
                timeout_s: float) -> tuple[Any, Any, list[int]]:
    """(this rank's node group (gloo), its cross group (``backend``), the cross group's global ranks in
    node order), made by the ranks that belong
    to each (torch.distributed ``use_local_synchronization``): collective over ``group`` in the sense
    that every rank of it must call this, in the same order relative to its other group creations."""
    import torch.distributed as dist

    members = dist.get_process_group_ranks(group) if group is not None else list(range(layout.world))
    m, li = layout.place(rank)
    node = [members[r] for r in layout.by_node[m]]
    cross = [members[layout.rank_at(n, li)] for n in range(layout.count)]
    timeout = timedelta(seconds=max(timeout_s, 1.0))
    local_group = dist.new_group(node, timeout=timeout, backend="gloo", use_local_synchronization=True)
    cross_group = dist.new_group(cross, timeout=timeout, backend=backend, use_local_synchronization=True)
    return local_group, cross_group, cross


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
    gather(out, x, group=group)


class CrossFailure(RuntimeError):
    """A torch.distributed call between the nodes failed (a peer's timeout, a closed connection): the
    cross group cannot be trusted after it (gloo closes its pairs on a timeout, a pending op cannot be
    taken back), so the communicator that owns it breaks (``MultiNodeCommunicator._run``)."""

    def __init__(self, what: str, error: BaseException):
        self.timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        super().__init__(f"{what} failed: {type(error).__name__}: {error}")


def _guarded(what: str):
    """Wrap a CrossLink method: an error of torch.distributed becomes a :class:`CrossFailure`."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (RuntimeError, OSError) as e:  # torch.distributed raises DistError (a RuntimeError) et al.
                raise CrossFailure(what, e) from e
        return call
    return wrap


class CrossLink:
    """Copies between the nodes' ranks of one local index: ``index`` is this rank's node index, ``n``
    the nodes, ``ranks`` the global rank of each node's member in node order (the group numbers its
    members in ascending global rank; the blocks here are always in node order). Tensors are moved
    as bytes; sizes are in rows of dim 0."""

    def __init__(self, group: Any, index: int, ranks: Sequence[int]):
        self.group, self.index, self.n = group, index, len(ranks)
        by_rank = sorted(range(self.n), key=lambda m: ranks[m])
        self._node_at = by_rank  # group rank g -> node index
        self._group_rank = [by_rank.index(m) for m in range(self.n)]  # node index -> group rank
        self._identity = by_rank == list(range(self.n))

    def _to_nodes(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Blocks in group-rank order -> node order."""
        return [blocks[g] for g in self._group_rank]

    @_guarded("the all-gather between nodes")
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n * rows, ...]: every node's ``x`` (equal shapes) in node order."""
        out = torch.empty((self.n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        if self.n == 1 or x.numel() == 0:
            return out.copy_(x) if self.n == 1 else out
        _all_gather(_bytes(out), _bytes(x), self.group)
        return out if self._identity else torch.cat(self._to_nodes(out.chunk(self.n)))

    @_guarded("the all-to-all between nodes")
    def all_to_all(self, x: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        """``send[m]`` rows of ``x`` (in order) go to node m; ``recv[m]`` rows come from node m, in node order."""
        rest = tuple(x.shape[1:])
        out = torch.empty((sum(recv),) + rest, dtype=x.dtype, device=x.device)
        row = x.element_size() * int(torch.Size(rest).numel())
        if row == 0 or self.n == 1:  # the same on every rank of the call (rows have one shape)
            return out if row == 0 else out.copy_(x)
        import torch.distributed as dist

        if not self._identity:  # to group-rank order
            blocks = x.split(list(send))
            x = torch.cat([blocks[m] for m in self._node_at])
            send = [send[m] for m in self._node_at]
            recv_g = [recv[m] for m in self._node_at]
        else:
            recv_g = list(recv)
        dist.all_to_all_single(_bytes(out), _bytes(x), [r * row for r in recv_g], [s * row for s in send],
                               group=self.group)
        return out if self._identity else torch.cat(self._to_nodes(out.split(recv_g)))

    @_guarded("the broadcast between nodes")
    def broadcast(self, x: torch.Tensor, src_index: int) -> None:
        """``x`` of node ``src_index``'s rank into ``x`` on every node (in place)."""
        if self.n == 1 or x.numel() == 0:
            return
        import torch.distributed as dist

        buf = x if x.is_contiguous() else x.contiguous()
        dist.broadcast(_bytes(buf), group_src=self._group_rank[src_index], group=self.group)
        if buf is not x:
            x.copy_(buf)
