"""Faults a user meets, injected on purpose: each must end in a clear PurlinError on every rank,
within the configured timeout, leaving nothing behind (issue: reliability).

* a shared-memory file system too small for the host workspace (a container's 64 MiB /dev/shm);
* mapping the workspace failing on one rank (a virtual-memory limit);
* a rank that dies while the Communicator is being built, and a rank that never comes;
* constructor arguments of the wrong kind;
* a communicator broken by a timeout releasing its memory at once;
* all_to_all_v splits that disagree between ranks, told in the caller's terms.
"""

import os
import resource
import subprocess
import tempfile
import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.errors import PurlinBrokenError, PurlinTimeoutError, PurlinUnavailableError, PurlinValueError
from purlin_sglang.memory import host
from purlin_sglang.testing import WorkerError, launch

MiB = 1 << 20


def _small_tmpfs(size_mib: int):
    """A real tmpfs of ``size_mib`` MiB (root can mount one), else None."""
    d = tempfile.mkdtemp(prefix="purlin-tmpfs-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", d],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        r = None
    if r is None or r.returncode != 0:
        os.rmdir(d)
        return None
    return d


def _unmount(d: str) -> None:
    subprocess.run(["umount", d], capture_output=True, timeout=20)
    os.rmdir(d)


def _purlin_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.startswith("purlin-"))


# -- 1. a small /dev/shm ------------------------------------------------------------------------
def _mp_small_shm(rank, world, shm_dir, fake_free, lie_about_space):
    if fake_free is not None:  # no tmpfs could be mounted: the free-space probe reports a small one
        host.shm_free_bytes = lambda d: fake_free
    if lie_about_space:  # the probe says "plenty": the allocation itself must catch it
        host.shm_free_bytes = lambda d: 1 << 40
    t0 = time.monotonic()
    try:
        ps.Communicator(config={"staging_bytes": 4 * MiB, "timeout_s": 20, "shm_dir": shm_dir})
    except PurlinUnavailableError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("lie_about_space", [False, True], ids=["probe", "fallocate"])
def test_small_shm_is_a_clear_error_on_every_rank(lie_about_space):
    d = _small_tmpfs(2)
    fake_free = None
    if d is None:
        if lie_about_space:
            pytest.skip("needs a real small tmpfs (mount -t tmpfs needs root): the probe case covers the rest")
        d, fake_free = tempfile.mkdtemp(prefix="purlin-shm-"), 2 * MiB
    try:
        res = launch(_mp_small_shm, 3, d, fake_free, lie_about_space, timeout_s=90)
        for rank, (msg, secs) in enumerate(res):
            assert msg is not None, f"rank {rank} built a communicator on a {d} too small for it"
            assert "needs" in msg and "free" in msg and "--shm-size" in msg and "staging_bytes" in msg, msg
            assert str(d) in msg, msg
            assert secs < 15
        assert _purlin_files(d) == []  # nothing left behind
    finally:
        if fake_free is None:
            _unmount(d)
        else:
            os.rmdir(d)


# -- 2. mapping fails on one rank ----------------------------------------------------------------
def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _mp_map_fails(rank, world, bad_rank, shm_dir):
    staging = 256 * MiB
    limit = None
    if rank == bad_rank:  # room for some growth, not for a world x 256 MiB mapping
        limit = _vm_size() + 64 * MiB
        old = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    t0 = time.monotonic()
    try:
        ps.Communicator(config={"staging_bytes": staging, "timeout_s": 20, "shm_dir": shm_dir})
        out = None
    except PurlinUnavailableError as e:
        out = str(e)
    finally:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, old)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("bad_rank", [0, 1], ids=["creator", "peer"])
def test_mapping_failure_on_one_rank_is_agreed(bad_rank):
    d = tempfile.mkdtemp(prefix="purlin-shm-")
    try:
        res = launch(_mp_map_fails, 3, bad_rank, d, timeout_s=90)
        for rank, (msg, secs) in enumerate(res):
            assert msg is not None, f"rank {rank} built a communicator although rank {bad_rank} could not map"
            assert f"rank {bad_rank}" in msg and "map" in msg, msg
            assert secs < 15
        assert _purlin_files(d) == []
    finally:
        os.rmdir(d)


# -- 3 and 5. a rank dies during construction, a rank never comes ----------------------------------
def _mp_dies_after_create(rank, world, shm_dir):
    if rank == 0:
        orig = host.HostWorkspace.create_shared

        def create_then_die(*a, **k):
            orig(*a, **k)
            os._exit(7)  # killed after creating the shared file, before any peer opened it

        host.HostWorkspace.create_shared = create_then_die
    t0 = time.monotonic()
    try:
        ps.Communicator(config={"staging_bytes": 64 * 1024, "timeout_s": 3, "shm_dir": shm_dir})
    except PurlinTimeoutError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def _mp_construct(rank, world, shm_dir):
    with ps.Communicator(config={"staging_bytes": 64 * 1024, "timeout_s": 10, "shm_dir": shm_dir}) as comm:
        return comm.all_reduce(torch.tensor([1.0])).item()


def test_rank_dying_in_construction_times_out_and_leaves_no_file():
    d = tempfile.mkdtemp(prefix="purlin-shm-")
    try:
        with pytest.raises(WorkerError) as info:
            launch(_mp_dies_after_create, 3, d, timeout_s=60, fail_grace_s=30)
        e = info.value
        assert e.failures[0].kind == "died" and e.failures[0].exitcode == 7
        for r in (1, 2):
            assert r not in e.failures, e.failures.get(r)
            msg, secs = e.results[r]
            assert msg is not None and "timeout_s" in msg, msg
            assert secs < 3 + 10
        assert _purlin_files(d) == []  # the dead creator's file, removed by the survivors
        assert launch(_mp_construct, 2, d, timeout_s=60) == [2.0, 2.0]  # the host is fine afterwards
        assert _purlin_files(d) == []
    finally:
        for f in _purlin_files(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


def _mp_one_rank_absent(rank, world):
    if rank == world - 1:
        time.sleep(12)  # takes another code path: never builds its communicator in time
        return None
    t0 = time.monotonic()
    try:
        ps.Communicator(config={"staging_bytes": 4096, "timeout_s": 2})
    except PurlinTimeoutError as e:
        return str(e), list(e.missing), time.monotonic() - t0
    return None


def test_construction_is_bounded_by_timeout_s_and_names_the_absent_rank():
    res = launch(_mp_one_rank_absent, 3, timeout_s=90)
    for rank in (0, 1):
        assert res[rank] is not None, f"rank {rank} built a communicator without rank 2"
        msg, missing, secs = res[rank]
        assert secs < 2 + 6, secs
        assert "timeout_s" in msg
    assert res[0][1] == [2] and "[2]" in res[0][0]  # the group's rank 0 sees who is missing


# -- 4. constructor arguments ----------------------------------------------------------------------
def _mp_bad_args(rank, world):
    out = []
    for kwargs in ({"device": "gpu"}, {"device": 5}, {"device": True}, {"device": "meta"}, {"device": 1.5},
                   {"group": "WORLD"}, {"group": 0}):
        try:
            ps.Communicator(**kwargs, config={"staging_bytes": 4096, "timeout_s": 5})
            out.append((kwargs, None, None))
        except Exception as e:  # noqa: BLE001 - the type is the check
            out.append((kwargs, type(e).__name__, str(e)))
    with ps.Communicator(config={"staging_bytes": 4096, "timeout_s": 5}) as comm:  # still fine afterwards
        out.append(comm.all_reduce(torch.tensor([1.0])).item())
    return out


def test_constructor_arguments_are_value_errors_naming_the_argument():
    res = launch(_mp_bad_args, 2, timeout_s=60)
    for out in res:
        assert out[-1] == 2.0
        for kwargs, kind, msg in out[:-1]:
            (arg, value), = kwargs.items()
            assert kind == "PurlinValueError", (kwargs, kind, msg)
            assert msg.startswith("Communicator: ") and f"{arg} must be" in msg, msg
            assert repr(value) in msg, msg
    assert "'cuda:5'" in res[0][1][2]  # device=5: says how to name GPU 5


def test_constructor_arguments_checked_without_a_process_group():
    for bad in ("gpu", 5, "meta"):
        with pytest.raises(PurlinValueError, match="device must be"):
            ps.Communicator(device=bad)


# -- 8. a broken communicator releases its memory at once -----------------------------------------------
def _shm_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/purlin-" in line)


def _mp_broken_releases(rank, world):
    comm = ps.Communicator(config={"staging_bytes": 1 << 20, "timeout_s": 2})
    mapped = _shm_mappings()
    if rank == 1:
        time.sleep(6)  # misses the call: rank 0 times out
        return mapped, None, None, None
    try:
        comm.all_reduce(torch.ones(8))
        return mapped, "no timeout", None, None
    except PurlinTimeoutError:
        pass
    after = _shm_mappings()  # at once: no garbage collection, no close()
    bytes_after = comm.workspace_bytes
    try:
        comm.all_gather(torch.ones(2))
        nxt = "accepted"
    except PurlinBrokenError as e:
        nxt = str(e)
    return mapped, after, bytes_after, nxt


def test_broken_communicator_releases_its_mapping_at_once():
    res = launch(_mp_broken_releases, 2, timeout_s=60)
    mapped, after, bytes_after, nxt = res[0]
    assert mapped >= 1 and after == 0, (mapped, after)
    assert bytes_after == 0
    assert nxt.startswith("all_gather: the communicator is broken") and "released" in nxt, nxt
    assert "timed out" in nxt or "waited" in nxt or "timeout" in nxt, nxt


# -- 9. all_to_all_v splits that disagree --------------------------------------------------------------
def test_all_to_all_v_split_mismatch_speaks_in_splits():
    def fn(comm):
        if comm.rank == 0:
            return comm.all_to_all_v(torch.ones(3, 2), [1, 2], [1, 2])  # sends 2 rows to rank 1
        return comm.all_to_all_v(torch.ones(3, 2), [2, 1], [3, 1])  # but rank 1 expects 3 from rank 0

    with pytest.raises(ps.PurlinMismatchError) as info:
        ps.run_virtual(2, fn, config={"staging_bytes": 4096, "timeout_s": 5})
    msg = str(info.value)
    assert msg.startswith("all_to_all_v: ")
    assert "input_splits" in msg and "output_splits" in msg and "rows" in msg, msg
    assert "bytes" not in msg, msg
    assert ("2 rows" in msg and "3 rows" in msg), msg


def test_all_to_all_v_local_split_errors_name_the_argument():
    def fn(comm):
        return comm.all_to_all_v(torch.ones(3, 2), [1, 1], [1, 2])

    with pytest.raises(PurlinValueError, match=r"all_to_all_v: input_splits sum to 2 rows but x has 3 rows"):
        ps.run_virtual(2, fn, config={"staging_bytes": 4096, "timeout_s": 5})


def test_all_to_all_v_own_slice_disagreement_names_both_arguments():
    """A rank whose input_splits[rank] and output_splits[rank] differ (its own slice, no peer involved)
    gets a PurlinValueError in the user's terms at once, not the planner's byte notation."""
    import random

    for seed in range(5):
        rng = random.Random(seed)
        world = rng.randint(2, 4)
        bad = rng.randrange(world)
        sizes = [rng.randint(1, 3) for _ in range(world)]

        def fn(comm, bad=bad, sizes=sizes):
            ins = list(sizes)
            if comm.rank == bad:
                ins[bad] += 1  # sends one more row to itself than it expects from itself
            x = torch.randn(sum(ins), 2)
            try:
                comm.all_to_all_v(x, ins, list(sizes))
            except PurlinValueError as e:
                return str(e)
            return None

        got = ps.run_virtual(world, lambda c: fn(c) if c.rank == bad else None,
                             config={"staging_bytes": 4096, "timeout_s": 5})
        msg = got[bad]
        assert msg == (f"all_to_all_v: rank {bad} sends {sizes[bad] + 1} rows to itself (input_splits[{bad}]) but "
                       f"expects {sizes[bad]} {'row' if sizes[bad] == 1 else 'rows'} from itself "
                       f"(output_splits[{bad}]); the two must be equal"), msg


def test_all_to_all_v_takes_torch_split_size_names():
    def fn(comm):
        w, r = comm.world_size, comm.rank
        send = [(r + q) % 3 + 1 for q in range(w)]  # rows rank r sends to q
        recv = [(p + r) % 3 + 1 for p in range(w)]  # rows rank r gets from p (= p's send[r])
        x = torch.arange(sum(send) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r
        a = comm.all_to_all_v(x, input_split_sizes=send, output_split_sizes=recv)
        b = comm.all_to_all_v(x, send, recv)
        with pytest.raises(PurlinValueError, match="give input_splits or input_split_sizes, not both"):
            comm.all_to_all_v(x, send, recv, input_split_sizes=send)
        return torch.equal(a, b) and a.shape[0] == sum(recv)

    assert ps.run_virtual(3, fn, config={"staging_bytes": 4096, "timeout_s": 10}) == [True] * 3
