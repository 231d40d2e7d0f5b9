"""Where a group's ranks run: :class:`NodeLayout`, and the block orders the two-level plans use.

Ranks are grouped by node id; nodes are taken in ascending id order, and inside a node its ranks in
ascending group rank (its *local* ranks 0..L-1). Rank ``(m, l)`` is local rank ``l`` of the m-th
node. The plans that cross nodes run inside each node over its L ranks and between nodes over the
N ranks of one local index (rank ``(0, l), (1, l), ...``): every node must hold the same L. The
tables are computed once per layout: the plans read them on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional


@dataclass(frozen=True)
class NodeLayout:
    """The node of every rank of a group (``nodes[r]``), and, where they came from the ranks' hosts,
    each rank's host (for messages)."""

    nodes: tuple[int, ...]
    hosts: Optional[tuple[str, ...]] = None

    @property
    def world(self) -> int:
        return len(self.nodes)

    @cached_property
    def node_ids(self) -> tuple[int, ...]:
        """The node ids in the order the plans take them (ascending)."""
        return tuple(sorted(set(self.nodes)))

    @cached_property
    def by_node(self) -> tuple[tuple[int, ...], ...]:
        """The group ranks of each node, in :attr:`node_ids` order, each ascending (positions: local ranks)."""
        return tuple(tuple(r for r, n in enumerate(self.nodes) if n == node) for node in self.node_ids)

    @property
    def count(self) -> int:
        """N: how many nodes."""
        return len(self.node_ids)

    def ranks_of(self, node: int) -> tuple[int, ...]:
        """The group ranks on node id ``node``, ascending (their local ranks are the positions)."""
        return self.by_node[self.node_ids.index(node)]

    @property
    def regular(self) -> bool:
        """True if every node holds the same number of ranks."""
        return len({len(rs) for rs in self.by_node}) == 1

    @property
    def local_size(self) -> int:
        """L: ranks per node (a regular layout)."""
        return self.world // self.count

    @cached_property
    def _places(self) -> dict[int, tuple[int, int]]:
        return {r: (m, li) for m, rs in enumerate(self.by_node) for li, r in enumerate(rs)}

    def place(self, rank: int) -> tuple[int, int]:
        """(node index m in :attr:`node_ids` order, local rank l) of group rank ``rank``."""
        return self._places[rank]

    def rank_at(self, m: int, local: int) -> int:
        """The group rank of node index ``m``, local rank ``local``."""
        return self.by_node[m][local]

    @cached_property
    def local_major(self) -> tuple[int, ...]:
        """Every group rank in (local rank, node) order: rank (0,0), (1,0), ..., (0,1), (1,1), ...
        (the order of blocks a rank's data takes after the between-nodes stage of a gather)."""
        return tuple(rs[li] for li in range(self.local_size) for rs in self.by_node)

    @cached_property
    def node_major(self) -> tuple[int, ...]:
        """Every group rank in (node, local rank) order: rank (0,0), (0,1), ..., (1,0), (1,1), ..."""
        return tuple(r for rs in self.by_node for r in rs)

    def describe(self) -> str:
        """``node 0: ranks [0, 1] on host-a; node 1: ranks [2, 3] on host-b`` (hosts where known)."""
        parts = []
        for n, ranks in zip(self.node_ids, self.by_node):
            rs = list(ranks)
            where = f" on {self.hosts[rs[0]].split('/')[0]}" if self.hosts else ""
            parts.append(f"node {n}: ranks {rs}{where}")
        return "; ".join(parts)

    @property
    def source(self) -> str:
        return "the ranks' hosts" if self.hosts else "topology.node_of_rank"
