"""The one launch helper for multi-process tests: :func:`launch`.

``launch(fn, world, *args)`` spawns ``world`` fresh processes (the ``spawn`` start
method: no state is inherited from the test process), builds a torch.distributed
process group in each (gloo over a FileStore in a private temporary directory, so
there is no port to race for), waits on a barrier, calls ``fn(rank, world, *args)``
and returns the return values in rank order. ``fn`` must be a picklable top-level
function; return values must be picklable (tensors are fine: they travel as bytes,
so a worker can exit as soon as it has answered).

Contracts:

* A worker that raises is reported in the parent as :class:`WorkerError`, with each
  failed rank's exception type, message and full traceback text; the original
  exception is attached where it can be pickled.
* A worker that dies without answering (a crash, ``os._exit``, a signal) is reported
  with its exit code.
* Nothing hangs: after ``timeout_s`` in all (or ``fail_grace_s`` after the first
  failure, for peers that are left waiting on the failed rank), the stragglers are
  terminated, then killed, and reported as timed out.
* Teardown always runs (``finally``): every worker destroys its process group, the
  parent reaps every process and removes the rendezvous directory.

Nothing here is CPU specific: ``backend`` and ``env`` (set in each worker's
environment before it starts, e.g. CUDA or NCCL variables) make it usable for GPU
multi-process tests too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping

__all__ = ["launch", "WorkerError", "WorkerFailure"]

_ENV_LOCK = threading.Lock()


@dataclass(frozen=True)
class WorkerFailure:
    """Why one rank did not return: ``kind`` is ``raised``, ``died`` or ``timeout``."""

    rank: int
    kind: str
    type_name: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    exception: BaseException | None = None

    def describe(self) -> str:
        if self.kind == "raised":
            return f"rank {self.rank} raised {self.type_name}: {self.message}\n{self.traceback}"
        if self.kind == "died":
            return f"rank {self.rank} died without answering (exit code {self.exitcode})"
        return f"rank {self.rank} did not answer in time and was killed"


class WorkerError(RuntimeError):
    """One or more ranks of :func:`launch` failed; ``failures`` maps rank -> :class:`WorkerFailure`."""

    def __init__(self, failures: dict[int, WorkerFailure], results: list):
        self.failures = dict(sorted(failures.items()))
        self.results = results  # what the ranks that did answer returned (None elsewhere)
        text = "\n".join(f.describe() for f in self.failures.values())
        super().__init__(f"launch: {len(self.failures)} rank(s) failed: {sorted(self.failures)}\n{text}")


def _worker(rank: int, world: int, store_path: str, backend: str, init_timeout_s: float,
            num_threads: int | None, fn: Callable, args: tuple, answers) -> None:
    """Body of one spawned rank (top level so that the spawn start method can pickle it)."""
    import torch
    import torch.distributed as dist

    if num_threads:
        torch.set_num_threads(num_threads)
    initialized = False
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=init_timeout_s))
        initialized = True
        dist.barrier()
        result = fn(rank, world, *args)
        answers.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            exc = pickle.dumps(e)
        except Exception:  # an exception that cannot travel: its text still does
            exc = None
        answers.put((rank, "raised", (type(e).__qualname__, str(e), traceback.format_exc(), exc)))
    finally:
        if initialized:
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 120.0,
    fail_grace_s: float = 10.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    num_threads: int | None = 1,
) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; return the results in rank order.

    Raises :class:`WorkerError` if any rank raised, died or ran past the deadline
    (``timeout_s`` for the whole launch; ``fail_grace_s`` after the first failure).
    ``env`` is added to each worker's environment; ``num_threads`` sets
    ``torch.set_num_threads`` in each worker (None leaves torch's default).
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"launch: world must be a positive int, got {world!r}")
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="purlin-launch-")
    answers = ctx.Queue()
    procs: list = []
    results: list = [None] * world
    failures: dict[int, WorkerFailure] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        store_path = os.path.join(tmpdir, "store")
        with _ENV_LOCK:  # spawn copies os.environ at start: set env only around the starts
            saved = {k: os.environ.get(k) for k in (env or {})}
            try:
                os.environ.update(env or {})
                for r in range(world):
                    p = ctx.Process(
                        target=_worker, name=f"purlin-rank{r}", daemon=True,
                        args=(r, world, store_path, backend, max(timeout_s, 1.0), num_threads, fn, args, answers),
                    )
                    p.start()
                    procs.append(p)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

        dead_since: dict[int, float] = {}
        while len(done) < world:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, status, payload = answers.get(timeout=0.05)
            except queue.Empty:
                rank = None
            if rank is not None:
                done.add(rank)
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    type_name, message, tb, exc = payload
                    try:
                        exception = pickle.loads(exc) if exc is not None else None
                    except Exception:
                        exception = None
                    failures[rank] = WorkerFailure(rank, "raised", type_name, message, tb, exception=exception)
                    deadline = min(deadline, time.monotonic() + fail_grace_s)
                continue
            for r, p in enumerate(procs):  # a rank that exited without answering
                if r in done or p.exitcode is None:
                    continue
                first = dead_since.setdefault(r, now)
                if now - first > 2.0:  # its answer, if any, would have arrived by now
                    done.add(r)
                    failures[r] = WorkerFailure(r, "died", exitcode=p.exitcode)
                    deadline = min(deadline, time.monotonic() + fail_grace_s)
        for r in range(world):
            if r not in done:
                failures[r] = WorkerFailure(r, "timeout")
    finally:
        for r, p in enumerate(procs):  # ranks that answered exit on their own; the others are killed
            p.join(timeout=5.0 if r in done else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        answers.close()
        answers.join_thread()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if failures:
        raise WorkerError(failures, results)
    return results
