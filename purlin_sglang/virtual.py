"""Loopback virtual ranks: the launch gate that makes ordinary host code in rank threads safe.

Virtual ranks on one GPU are threads of one process, each enqueuing its kernels on its own stream.
A rank's collective kernel waits on the device for its peers' kernels. If a rank thread, right
after a call, blocks the host (``.cpu()``, ``.item()``, ``print(tensor)``: a synchronous copy that
waits for its stream), and a peer's thread has not launched its part yet, that peer's launch can
stall behind the blocked copy, and the first wait of the collective times out.

The gate closes that window: in eager mode, a virtual CUDA rank launches a call only once every
virtual rank has reached it, and returns only once every virtual rank has enqueued it (two
host-side rendezvous per call, bounded by the config's ``timeout_s``). What remains unsafe is named
in :func:`purlin_sglang.run_virtual`'s docstring.
"""

from __future__ import annotations

import sys
import threading
import traceback

from .errors import PurlinBrokenError, PurlinMismatchError, PurlinTimeoutError


class LaunchGate:
    """Two host-side rendezvous per eager call of the virtual ranks, both bounded by ``timeout_s``:

    * :meth:`enter` before a rank launches call ``seq``: every rank has reached the call, so no
      rank's kernel of this call is in flight while another rank is still in host code before it
      (a device allocation or a synchronize there would wait for that kernel, which waits for it);
    * :meth:`launched` after it: every rank has enqueued the call, so a rank that blocks its host
      right after (``.cpu()``, ``.item()``) cannot stall a peer's launch.
    """

    def __init__(self, world: int, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        self._counts = {"reach": [0] * world, "launch": [0] * world}
        self._failed: dict[int, str] = {}
        self._calls: list = [None] * world  # per rank: (seq, fingerprint, description) of its latest call
        self._cond = threading.Condition()

    def enter(self, rank: int, seq: int, op: str, fingerprint: int = 0, what: str = "") -> None:
        """Meet every rank at call ``seq``; ranks whose calls differ (``fingerprint``: the call's
        cross-rank invariants; ``what``: how to name it) get a PurlinMismatchError naming both sides."""
        with self._cond:
            self._calls[rank] = (seq, fingerprint, what or op)
        self._meet("reach", rank, seq, op)
        with self._cond:
            mine = self._calls[rank]
            for peer, theirs in enumerate(self._calls):
                if theirs is not None and theirs[0] == seq and theirs[1] != mine[1]:
                    raise PurlinMismatchError(
                        f"{op}: rank {rank} and rank {peer} entered call #{seq} with different collectives, dtypes, "
                        f"roots or sizes: rank {rank} called {mine[2]}, rank {peer} called {theirs[2]}; every rank "
                        "must make the same calls in the same order", op=op, rank=rank, peer=peer)

    def launched(self, rank: int, seq: int, op: str) -> None:
        self._meet("launch", rank, seq, op)

    def _meet(self, what: str, rank: int, seq: int, op: str) -> None:
        counts = self._counts[what]
        with self._cond:
            if seq > counts[rank]:
                counts[rank] = seq
                self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._failed or min(counts) >= seq, self.timeout_s)
            if self._failed and min(counts) < seq:
                r, why = next(iter(self._failed.items()))
                raise PurlinBrokenError(f"{op}: rank {r} failed before it {what}ed call #{seq} ({why})")
            if not done:
                late = [r for r, n in enumerate(counts) if n < seq]
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {late}"
                raise PurlinTimeoutError(
                    f"{op}: rank {rank} waited {self.timeout_s:g}s (timeout_s) for call #{seq}: {who} never "
                    f"{'reached' if what == 'reach' else 'launched'} it (loopback virtual ranks). Where their "
                    f"threads were:\n{thread_stacks(late)}",
                    op=op, rank=rank, missing=late)

    def fail(self, rank: int, why: str) -> None:
        """Rank ``rank`` raised: release the ranks waiting for it."""
        with self._cond:
            self._failed.setdefault(rank, why)
            self._cond.notify_all()


def thread_stacks(ranks: list[int]) -> str:
    """The current Python stacks of the rank threads ``purlin-vrank<r>`` (the innermost frames)."""
    names = {f"purlin-vrank{r}": r for r in ranks}
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.name in names and t.ident in frames:
            stack = "".join(traceback.format_stack(frames[t.ident], limit=6))
            out.append(f"  rank {names[t.name]} ({t.name}):\n{stack}")
    return "\n".join(out) if out else "  (no rank thread is alive)"
