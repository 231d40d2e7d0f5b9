"""Where a group's ranks run: :class:`NodeLayout`, and the block orders the two-level plans use.

Ranks are grouped by node id; nodes are taken in ascending id order, and inside a node its ranks in
ascending group rank (its *local* ranks 0..L-1). Rank ``(m, l)`` is local rank ``l`` of the m-th
node. The plans that cross nodes run inside each node over its L ranks and between nodes over the
N ranks of one local index (rank ``(0, l), (1, l), ...``): every node must hold the same L.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def node_ids(self) -> tuple[int, ...]:
        """The node ids in the order the plans take them (ascending)."""
        return tuple(sorted(set(self.nodes)))

    @property
    def count(self) -> int:
        """N: how many nodes."""
        return len(set(self.nodes))

    def ranks_of(self, node: int) -> tuple[int, ...]:
        """The group ranks on node id ``node``, ascending (their local ranks are the positions)."""
        return tuple(r for r, n in enumerate(self.nodes) if n == node)

    @property
    def regular(self) -> bool:
        """True if every node holds the same number of ranks."""
        return len({len(self.ranks_of(n)) for n in self.node_ids}) == 1

    @property
    def local_size(self) -> int:
        """L: ranks per node (a regular layout)."""
        return self.world // self.count

    def place(self, rank: int) -> tuple[int, int]:
        """(node index m in :attr:`node_ids` order, local rank l) of group rank ``rank``."""
        node = self.nodes[rank]
        return self.node_ids.index(node), self.ranks_of(node).index(rank)

    def rank_at(self, m: int, local: int) -> int:
        """The group rank of node index ``m``, local rank ``local``."""
        return self.ranks_of(self.node_ids[m])[local]

    def local_major(self) -> tuple[int, ...]:
        """Every group rank in (local rank, node) order: rank (0,0), (1,0), ..., (0,1), (1,1), ...
        (the order of blocks a rank's data takes after the between-nodes stage of a gather)."""
        n, size = self.count, self.local_size
        return tuple(self.rank_at(m, li) for li in range(size) for m in range(n))

    def describe(self) -> str:
        """``node 0: ranks [0, 1] on host-a; node 1: ranks [2, 3] on host-b`` (hosts where known)."""
        parts = []
        for n in self.node_ids:
            rs = list(self.ranks_of(n))
            where = f" on {self.hosts[rs[0]].split('/')[0]}" if self.hosts else ""
            parts.append(f"node {n}: ranks {rs}{where}")
        return "; ".join(parts)

    @property
    def source(self) -> str:
        return "the ranks' hosts" if self.hosts else "topology.node_of_rank"
