"""A Communicator whose group spans nodes: every collective in two levels.

:func:`become` turns a :class:`~purlin_sglang.Communicator` under construction into a
``purlin_sglang.api.MultiNodeCommunicator`` (:class:`TwoLevel` + Communicator) once its ranks were
found on several nodes. It then holds ``local``,
a purlin Communicator of its node's L ranks (the CPU or CUDA engine, as on one node), and ``link``,
a :class:`~.cross.CrossLink` among the N ranks of its local index (torch.distributed). Each
collective is a fixed sequence of stages on those two (docs/MULTINODE.md has the bytes of each):

* all_reduce: reduce-scatter inside the node (purlin) -> all-gather of the node partials across
  nodes -> reduction of the N partials in node order on each rank -> all-gather inside the node;
* reduce_scatter(_v): reduce-scatter inside the node of the blocks ordered by local rank, then an
  all-to-all of the node partials across nodes and their reduction in node order;
* all_gather(_v): all-gather across nodes, then inside the node;
* all_to_all(_v): inside the node to the rank of the destination's local index, then across nodes;
* broadcast: across nodes among the root's local index, then inside each node.

Reductions are two-level and fixed: inside a node in local rank order (purlin's defined order),
then over nodes in node-id order, each level accumulating 16-bit floats in float32 and rounding to
the dtype once (``purlin_sglang.reference.two_level_reduce``). Every rank gets bitwise the same
result, independent of the batch size; for max and min it equals the one-node result, for sum in
general it does not (a different association). The MoE exchange runs the CPU engine's MoE steps
over these collectives (:mod:`.moe`). Host side: the call blocks as the CPU engine's calls do; on
CUDA the stages are enqueued on the current stream (NCCL between nodes) and capturable in a CUDA
graph, except all_to_all_v and the MoE exchange, which read row counts on the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, NoReturn, Optional

import torch

from ..calls import CacheInfo, CallPath
from ..collectives import CollectiveSpec
from ..engines import closed_error
from ..engines.base import first_split_mismatch
from ..errors import (PurlinBrokenError, PurlinError, PurlinMismatchError, PurlinTimeoutError, PurlinUnavailableError,
                      PurlinValueError, rejected_error, text_words, words_text)
from .cross import CrossFailure, CrossLink, backend_for, make_groups
from .layout import NodeLayout
from .moe import make_moe

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
STATUS_WORDS = 64  # the status round's message: 512 bytes of a rank's own argument error


def become(comm: Any, cls: type, group: Any, rank: int, world: int, layout: NodeLayout) -> None:
    """Finish constructing the Communicator ``comm`` as ``cls`` (a subclass of it and of
    :class:`TwoLevel`: ``purlin_sglang.api.MultiNodeCommunicator``) over ``layout`` (collective over
    ``group``); a group that cannot run across its nodes raises PurlinTopologyError on every rank."""
    backend = backend_for(comm.config.topology.inter_node, comm.device, layout)  # the same answer on every rank
    comm.__class__ = cls
    comm._init_nodes(group, rank, world, layout, backend)


def reduce_nodes(parts: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of ``parts`` [N, ...] over dim 0 in order (16-bit floats accumulated in float32),
    cast to ``dtype``: the second level of :func:`purlin_sglang.reference.two_level_reduce`."""
    acc = parts[0].to(_ACC.get(dtype, dtype), copy=True)
    for p in parts[1:]:
        if op == "sum":
            acc.add_(p)
        elif op == "max":
            torch.maximum(acc, p.to(acc.dtype), out=acc)
        else:
            torch.minimum(acc, p.to(acc.dtype), out=acc)
    return acc.to(dtype)


def _even(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` sizes, the first ``n % parts`` one larger."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


class TwoLevel:
    """What a Communicator over several nodes does differently (``purlin_sglang.api.MultiNodeCommunicator``
    derives from this and from Communicator; ``Communicator(...)`` makes one itself when the group's
    ranks sit on several nodes; see the module). The same API and contracts, with these differences:
    reductions are two-level (module docstring); ``algorithm`` answers ``two-level``;
    ``symmetric_empty``, ``cache_info`` and ``tuning_info`` are the node stage's; a spec outside the
    catalog raises PurlinUnavailableError. One rank's argument error: on the CPU engine every call
    begins with a status round (:meth:`_agree`), so every rank raises (the peers a PurlinRejectedError
    quoting it) and the communicator stays usable; on CUDA it raises on the erring rank only (a status
    round would read the device on the host every call), and its peers wait for it up to ``timeout_s``.
    A failed exchange between the nodes (a timeout, a closed connection) breaks the communicator: the
    stage's PurlinTimeoutError or PurlinBrokenError, then PurlinBrokenError on every later call."""

    _node_class: type  # the Communicator class of the node stage (set by the class that derives from both)

    def _init_nodes(self, group: Any, rank: int, world: int, layout: NodeLayout, backend: str) -> None:
        self.rank, self.world_size, self.group = rank, world, group
        self.layout = layout
        self.inter_node_backend = backend
        self._node_index, self._local_rank = layout.place(rank)
        self._moe = None
        self._seq = 0
        self._path = CallPath(rank, world, self.device, self.config, packets=False)
        local_group, cross_group, cross_ranks = make_groups(group, layout, rank, backend,
                                                            self.config.timeouts.setup_s)
        cfg = self.config.model_copy(update={"topology": self.config.topology.model_copy(
            update={"node_of_rank": (0,) * layout.local_size})})
        self.local = self._node_class(local_group, self.device, cfg)  # a plain Communicator of the node
        self.link = CrossLink(cross_group, self._node_index, cross_ranks)
        self.engine_name = f"{self.local.engine_name}+{backend}"
        self._status_round = self.device.type == "cpu"  # host values: the round costs no device sync
        self._closed = False
        self._moe = make_moe(self)

    # -- what the node stage answers ----------------------------------------------------------
    @property
    def workspace_bytes(self) -> int:
        return 0 if self._closed else self.local.workspace_bytes

    @property
    def hbm_bytes(self) -> int:
        return 0 if self._closed else self.local.hbm_bytes

    @property
    def moe_hbm_bytes(self) -> int:
        return 0

    def moe_trace(self) -> None:
        """None: the two-level MoE exchange has no kernel phases."""
        self._check_usable("moe_trace")
        return None

    def symmetric_empty(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._check_usable("symmetric_empty")
        return self.local.symmetric_empty(shape, dtype)

    def cache_info(self) -> CacheInfo:
        return self.local.cache_info()

    def algorithm(self, collective: str | CollectiveSpec, nbytes: int | None) -> str:
        self._path.select(collective, nbytes)  # the same argument checks
        return "two-level"

    def tuning_info(self):
        return self.local.tuning_info()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "ready"
        return (f"MultiNodeCommunicator(rank={self.rank}, world_size={self.world_size}, nodes={self.layout.count}, "
                f"device={self.device}, engine={self.engine_name}, {state})")

    # -- the call path -----------------------------------------------------------------------
    def _announce(self, op: str, error: PurlinValueError) -> NoReturn:
        """This rank rejected its own arguments of ``op``: where calls begin with a status round, it takes
        part with ``error`` (every peer then raises a PurlinRejectedError quoting it); ``error`` is raised."""
        if self._status_round and not self._closed:
            self._agree(op, error)
        raise error

    def _agree(self, op: str, error: Optional[PurlinValueError]) -> None:
        """The status round that begins every call on the CPU engine: each rank's status (0, or 1 and its
        own argument error's text) all-gathered inside the node (purlin) and then across the nodes
        (fixed sizes, so a rank with bad arguments can take part). Every rank spends the call number;
        if any rank rejected its arguments, the others raise :func:`~purlin_sglang.errors.rejected_error`
        naming the lowest such rank, before any data moves, and nothing is left pending."""
        mine = torch.zeros(1 + STATUS_WORDS, dtype=torch.int64)
        if error is not None:
            mine[0] = 1
            mine[1:] = torch.tensor(text_words(str(error), STATUS_WORDS), dtype=torch.int64)
        self._seq += 1
        try:
            every = self.link.all_gather(self.local.all_gather(mine))
        except CrossFailure as e:
            raise self._cross_failed(op, e) from e
        except PurlinError:
            self._check_usable(op)
            raise
        rows = every.view(self.layout.count, self.layout.local_size, -1)
        causes = {self.layout.rank_at(m, j): words_text(rows[m, j, 1:].tolist())
                  for m in range(self.layout.count) for j in range(self.layout.local_size) if int(rows[m, j, 0])}
        causes.pop(self.rank, None)
        if causes and error is None:
            raise rejected_error(op, causes, self._seq)

    def _cross_failed(self, op: str, failure: CrossFailure) -> PurlinError:
        """The error of a failed exchange between nodes, this communicator broken and its memory released:
        PurlinTimeoutError where the backend timed out, else PurlinBrokenError."""
        msg = (f"{op}: rank {self.rank}: {failure} (the {self.inter_node_backend} group of local index "
               f"{self._local_rank}, {self.layout.count} nodes); a rank of another node skipped this call, failed or "
               "is stuck; the communicator is now broken")
        self._broken_reason = msg
        self.close()
        if failure.timed_out:
            return PurlinTimeoutError(msg, op=op, rank=self.rank)
        return PurlinBrokenError(msg + "; create a new Communicator on every rank")

    def _check_usable(self, name: str) -> None:
        if self._closed:
            raise closed_error(name, self._broken_reason)
        if self.local.closed:
            self._broken_reason = self.local._broken_reason or "its node stage was closed"
            self._closed = True
            raise closed_error(name, self._broken_reason)

    def _run(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any, out_splits: Any) -> torch.Tensor:
        name = spec.name if isinstance(spec, CollectiveSpec) else "run"
        self._check_usable(name)
        try:
            c = self._path.check(spec, x, out, op, root, in_splits, out_splits)
        except PurlinValueError as e:
            self._announce(name, e)
        stage = _STAGES.get(spec.name) if _catalog(spec) else None
        if stage is None:
            raise PurlinUnavailableError(
                f"{c.name}: a collective outside the catalog cannot run across nodes yet (the group spans "
                f"{self.layout.count} nodes); run it on a Communicator of one node")
        if self._status_round:
            self._agree(c.name, None)
        else:
            self._seq += 1
        try:
            res = stage(self, x, c, root)
        except CrossFailure as e:
            raise self._cross_failed(name, e) from e
        except PurlinError:
            self._check_usable(name)  # a stage that broke its engine closes this communicator
            raise
        if res is not c.out:
            c.out.copy_(res.reshape(c.out.shape))
        return c.out

    # -- stages ------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor, c, root) -> torch.Tensor:
        op = c.consume.reduce.value
        flat = x.reshape(-1)
        parts = _even(flat.numel(), self.layout.local_size)
        shard = self.local.reduce_scatter_v(flat, parts, op)
        res = reduce_nodes(self.link.all_gather(shard).view(self.layout.count, -1), op, x.dtype)
        return self.local.all_gather_v(res, parts)

    def _order(self, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Blocks in rank order -> in local-major order (:attr:`NodeLayout.local_major`)."""
        return [blocks[r] for r in self.layout.local_major]

    def _in_rank_order(self, blocks: Any, order: tuple[int, ...]) -> torch.Tensor:
        """``blocks[k]`` belongs to rank ``order[k]``: their concatenation in rank order."""
        by_rank: list[Optional[torch.Tensor]] = [None] * self.world_size
        for r, b in zip(order, blocks):
            by_rank[r] = b
        return torch.cat(by_rank)

    def _per_local(self, sizes: list[int]) -> list[int]:
        """Per local rank j: the sum of ``sizes`` over the ranks of local index j on every node."""
        return [sum(sizes[r] for r in self.layout.local_major[j * self.layout.count:(j + 1) * self.layout.count])
                for j in range(self.layout.local_size)]

    def _of_my_index(self, sizes: list[int]) -> list[int]:
        """``sizes`` of the ranks with this rank's local index, in node order."""
        return [sizes[rs[self._local_rank]] for rs in self.layout.by_node]

    def _reduce_scatter(self, x: torch.Tensor, c, root) -> torch.Tensor:
        return self._reduce_scatter_sizes(x, c, [x.shape[0] // self.world_size] * self.world_size)

    def _reduce_scatter_v(self, x: torch.Tensor, c, root) -> torch.Tensor:
        return self._reduce_scatter_sizes(x, c, list(c.in_rows))

    def _reduce_scatter_sizes(self, x: torch.Tensor, c, sizes: list[int]) -> torch.Tensor:
        op = c.consume.reduce.value
        n = self.layout.count
        xb = torch.cat(self._order(list(x.split(sizes)))) if x.shape[0] else x
        # the node partials of the blocks for ranks (m, li), m in node order
        partial = self.local.reduce_scatter_v(xb, self._per_local(sizes), op)
        send = self._of_my_index(sizes)
        mine = sizes[self.rank]
        got = self.link.all_to_all(partial, send, [mine] * n)
        return reduce_nodes(got.view((n, mine) + tuple(x.shape[1:])), op, x.dtype)

    def _all_gather(self, x: torch.Tensor, c, root) -> torch.Tensor:
        return self._gather_sizes(x, [x.shape[0]] * self.world_size)

    def _all_gather_v(self, x: torch.Tensor, c, root) -> torch.Tensor:
        return self._gather_sizes(x, list(c.out_rows))

    def _gather_sizes(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        mine = self._of_my_index(sizes)
        top = max(mine)
        if top != x.shape[0]:  # pad to the largest of my local index's rows, to gather equal blocks
            x = torch.cat([x, x.new_empty((top - x.shape[0],) + tuple(x.shape[1:]))])
        across = self.link.all_gather(x)
        if top != min(mine):
            across = torch.cat([b[:k] for b, k in zip(across.split(top), mine)])
        allg = self.local.all_gather_v(across, self._per_local(sizes))
        order = self.layout.local_major
        return self._in_rank_order(allg.split([sizes[r] for r in order]), order)

    def _all_to_all(self, x: torch.Tensor, c, root) -> torch.Tensor:
        rows = x.shape[0] // self.world_size
        return self._exchange(x, [rows] * self.world_size, [rows] * self.world_size)

    def _all_to_all_v(self, x: torch.Tensor, c, root) -> torch.Tensor:
        return self._exchange(x, list(c.in_rows), list(c.out_rows))

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """all_to_all_v in two hops: inside the node to the local rank of each destination, then across
        nodes. Every rank first learns every rank's splits (one two-level all_gather of 2W ints), so a
        disagreement raises PurlinMismatchError on every rank before any row moves."""
        lay, n, w, size = self.layout, self.layout.count, self.world_size, self.layout.local_size
        me = self.rank
        mat = self._gather_sizes(torch.tensor([send + recv], dtype=torch.int64, device=self.device), [1] * w)
        mat = mat.cpu().tolist()
        s = [row[:w] for row in mat]  # s[p][q]: rows p sends to q
        why = first_split_mismatch("all_to_all_v", s, [row[w:] for row in mat])
        if why is not None:
            raise PurlinMismatchError(why, op="all_to_all_v", rank=me)
        # hop 1, inside the node: to local rank j, my rows for (m, j), m in node order
        rest = tuple(x.shape[1:])
        blocks = list(x.split(send))
        hop = self._order(blocks)
        src = lay.by_node[self._node_index]  # my node's ranks, by local rank
        out1 = self._per_local(s[me])
        in1 = [sum(self._of_my_index(s[p])) for p in src]
        got = self.local.all_to_all_v(torch.cat(hop) if hop else x, out1, in1)
        # on the relay: from local rank j, blocks for (m, li) in node order -> regroup by node m
        mine = [self._of_my_index(s[p]) for p in src]  # mine[j][m]: rows local rank j sends to (m, li)
        pieces = got.split([k for row in mine for k in row])
        by_node = [pieces[j * n + m] for m in range(n) for j in range(size)]
        send2 = [sum(col) for col in zip(*mine)]
        recv2 = [sum(recv[lay.rank_at(m, j)] for j in range(size)) for m in range(n)]
        body = torch.cat(by_node) if by_node else got
        across = self.link.all_to_all(body.reshape((-1,) + rest), send2, recv2)
        # from node m, blocks of sources (m, j), j in order -> rank order
        order = lay.node_major
        return self._in_rank_order(across.split([recv[r] for r in order]), order)

    def _broadcast(self, x: torch.Tensor, c, root: int) -> torch.Tensor:
        out = c.out
        if self.rank == root and out.data_ptr() != x.data_ptr():
            out.copy_(x)
        m0, l0 = self.layout.place(root)
        if self._local_rank == l0:
            self.link.broadcast(out, m0)
        self.local.broadcast(out, l0)
        return out

    # -- lifetime ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        self._check_usable("synchronize")
        self.local.synchronize()

    def pending_error(self):
        """The node stage's recorded error (Communicator.pending_error); the stages between nodes raise as
        they run."""
        local = getattr(self, "local", None)
        return None if self._closed or local is None else local.pending_error()

    @contextlib.contextmanager
    def capture(self):
        """The node stage's capture context (the stages between nodes are NCCL calls on the current
        stream, capturable as NCCL's are)."""
        self._check_usable("capture")
        with self.local.capture():
            yield self

    def close(self) -> None:
        if self._closed and getattr(self, "local", None) is None:
            return
        self._closed = True
        local, self.local = getattr(self, "local", None), None
        self._moe = None
        if local is not None:
            local.close()


def _catalog(spec: Any) -> bool:
    from ..collectives import CATALOG

    return isinstance(spec, CollectiveSpec) and CATALOG.get(spec.name) is spec


_STAGES = {
    "all_reduce": TwoLevel._all_reduce,
    "reduce_scatter": TwoLevel._reduce_scatter,
    "reduce_scatter_v": TwoLevel._reduce_scatter_v,
    "all_gather": TwoLevel._all_gather,
    "all_gather_v": TwoLevel._all_gather_v,
    "all_to_all": TwoLevel._all_to_all,
    "all_to_all_v": TwoLevel._all_to_all_v,
    "broadcast": TwoLevel._broadcast,
}
