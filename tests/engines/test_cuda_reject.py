"""A CUDA process group rank that rejects its own arguments (CudaEngine.reject), checked without a GPU:
two real CudaEngines whose workspaces are CPU tensors and whose library copies with memmove; the peer's
kernel is modelled by what native/snac/ops.cuh desc_differs does when a wait for the rejecting rank
stalls (read the descriptor slot, record a MISMATCH in the host record's format)."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch

from purlin_sglang import engines, native
from purlin_sglang.engines import cuda as cuda_mod
from purlin_sglang.engines.base import fold32
from purlin_sglang.errors import PurlinBrokenError, PurlinMismatchError, PurlinRejectedError, PurlinTimeoutError
from purlin_sglang.memory.layout import REJECT_WORDS, DeviceLayout

STAGING = 1 << 16
F = native.SNAC_ERROR_FIELDS


class _Lib:
    def __init__(self, fail=False):
        self.copies, self.fail = [], fail

    def copy_atom(self, dst, src, nbytes, stream, max_blocks=0, device=-1):
        if self.fail:
            raise RuntimeError("no device")
        self.copies.append((dst, nbytes))
        ctypes.memmove(dst, src, nbytes)


class _Stream:
    cuda_stream = 0

    def query(self):
        return True


class _Ws:
    def __init__(self, tensors):
        self.tensors = tensors
        self.base_ptrs = [t.data_ptr() for t in tensors]


def _engines(world, monkeypatch, call_check=True, fail=False):
    dl = DeviceLayout(world, STAGING)
    ws = _Ws([torch.zeros(dl.rank_bytes // 8, dtype=torch.int64) for _ in range(world)])
    monkeypatch.setattr(cuda_mod, "_pinned_words", lambda words: torch.tensor(words, dtype=torch.int64))
    monkeypatch.setattr(cuda_mod, "_side_stream", lambda device: _Stream())
    out = []
    for r in range(world):
        e = cuda_mod.CudaEngine.__new__(cuda_mod.CudaEngine)
        e.ws, e.rank, e.world, e.timeout_s, e.dlayout = ws, r, world, 60.0, dl
        e.device, e._index, e.lib, e.call_check = torch.device("cpu"), 0, _Lib(fail), call_check
        e._err = torch.zeros(cuda_mod.HOST_ERROR_WORDS, dtype=torch.int64).numpy()
        e._names, e.broken, e._reject_causes, e._reject_buf = ["all_reduce"], None, {}, None
        e.can_resync, e._resync_rounds, e._resync_keep, e._stream = call_check and world > 1, 0, [], None
        out.append(e)
    return ws, dl, out


def _kernel_waits_for(e, producer, seq, fp):
    """Rank e's kernel of call ``seq`` (fingerprint ``fp``) stalls waiting for ``producer``: as desc_differs,
    it reads the producer's descriptor slot in its own workspace and records a mismatch if it differs."""
    w = e.ws.tensors[e.rank]
    slot = e.dlayout.desc(producer, seq) // 8
    theirs, lo, hi = (int(v) for v in w[slot:slot + 3])
    mine = cuda_mod.desc_word(seq, fold32(fp))
    if theirs >> 32 != mine >> 32 or theirs == mine:
        return False
    same = lambda v: v if v >> 32 == mine >> 32 else 0  # noqa: E731
    rec = {"code": native.SNAC_ERROR_CODES["MISMATCH"], "op": 3, "kind": 1, "peer": producer, "item": 0,
           "rank": e.rank, "target": mine, "seen": theirs, "tag": 0, "peer_info_lo": same(lo),
           "peer_info_hi": same(hi), "my_info": 0}
    for k, v in rec.items():
        e._err[F.index(k)] = v
    return True


def test_descriptor_words_are_the_kernels_and_only_a_rejection_carries_the_marks():
    assert cuda_mod.desc_word(5, 0x1234) == (5 << 32) | 0x1234
    assert cuda_mod.desc_word(1 << 31, 1) < 0  # a signed int64, as the record holds it
    mark = cuda_mod.desc_word(9, cuda_mod.REJECT_MARK)
    assert cuda_mod.rejected_marks(mark, mark, mark)
    assert not cuda_mod.rejected_marks(mark, 0, mark)  # words 1-2 of another call: not a rejection
    assert not cuda_mod.rejected_marks(cuda_mod.desc_word(9, 0x77), mark, mark)


def test_a_rejecting_rank_stops_its_peers_who_raise_quoting_its_error(monkeypatch):
    ws, dl, (r0, r1, r2) = _engines(3, monkeypatch)
    seq, message = 7, "all_reduce: out has dtype torch.float16; the input's is torch.float32"
    r1.reject(seq, "all_reduce", message)
    assert r1.resync_pending == ("all_reduce", seq) and not r1.broken  # the reset is owed, nothing broken
    # every peer's workspace: the message entry, then descriptor words 1-2, then word 0, for this call and the next
    peers = [(q, ws.base_ptrs[q]) for q in (0, 2)]
    assert r1.lib.copies == ([(b + dl.reject(1), REJECT_WORDS * 8) for _, b in peers]
                             + [(b + dl.desc(1, seq) + 8, 16) for _, b in peers]
                             + [(b + dl.desc(1, seq), 8) for _, b in peers]
                             + [(b + dl.desc(1, seq + 1) + 8, 16) for _, b in peers]
                             + [(b + dl.desc(1, seq + 1), 8) for _, b in peers])
    assert not ws.tensors[1].any()  # nothing written into the rejecting rank's own workspace
    for peer in (r0, r2):
        assert peer.recorded_error() is None
        assert _kernel_waits_for(peer, 1, seq, fp=0xABC)
        pending = peer.recorded_error()  # the watch's read: no device copy, so no quote yet
        assert isinstance(pending, PurlinRejectedError) and "could not be read" in str(pending)
        with pytest.raises(PurlinRejectedError) as err:
            peer.check()
        e = err.value
        assert e.rank == 1 and e.cause == message and e.op == "all_reduce"
        assert f'rank 1 rejected its arguments of call #{seq}: "{message}"' in str(e) and "stays usable" in str(e)
        assert peer.resync_pending == ("all_reduce", seq) and not peer.broken
    # a peer that learned of it passes it on: rank 0's entry in rank 2's workspace names rank 1 and its message
    w = ws.tensors[2]
    entry = dl.reject(0) // 8
    assert int(w[entry]) == seq and int(w[entry + 1]) >> 32 == 1 + 1 and int(w[entry + 1]) & 0xFFFFFFFF == len(message)


def test_a_rank_whose_part_did_not_wait_stops_at_its_next_call_naming_the_rejected_one(monkeypatch):
    """A broadcast's root finishes the rejected call without waiting for the rejecting rank: its next call's
    kernel, waiting for it, meets the marks of that next call and raises quoting the rejected call's number."""
    ws, dl, (r0, r1) = _engines(2, monkeypatch)
    r1.reject(4, "broadcast", "broadcast: root 5 is out of range")
    assert _kernel_waits_for(r0, 1, 5, fp=0x12)
    with pytest.raises(PurlinRejectedError) as err:
        r0.check()
    assert err.value.rank == 1 and err.value.cause == "broadcast: root 5 is out of range"
    assert "rank 1 rejected its arguments of call #4" in str(err.value) and r0.resync_pending == ("all_reduce", 4)


def test_a_rejection_passed_on_names_the_rank_that_rejected(monkeypatch):
    """Rank 2 waits for rank 0 only; rank 0 stopped on rank 1's rejection and passed it on: rank 2 stops on rank
    0's marks and names rank 1 and its message."""
    ws, dl, (r0, r1, r2) = _engines(3, monkeypatch)
    r1.reject(9, "all_reduce", "all_reduce: x is None")
    assert _kernel_waits_for(r0, 1, 9, fp=3)
    with pytest.raises(PurlinRejectedError):
        r0.check()
    # rank 1's own descriptor in rank 2's workspace is left as a waiting rank 2 would not see it (it waits for 0)
    assert _kernel_waits_for(r2, 0, 9, fp=3)
    with pytest.raises(PurlinRejectedError) as err:
        r2.check()
    assert err.value.rank == 1 and err.value.cause == "all_reduce: x is None"
    assert 'rank 1 rejected its arguments of call #9: "all_reduce: x is None"' in str(err.value)


def test_a_rank_whose_part_did_not_wait_raises_at_synchronize_once_the_marks_are_there(monkeypatch):
    """A broadcast's root: its kernel finished without waiting for the rejecting rank; synchronize() finds
    the rank's rejected descriptor of the last call in its own workspace and raises it, quoting the cause."""
    ws, dl, (r0, r1) = _engines(2, monkeypatch)
    r0._last = (4, 0)  # the root launched call 4 (tag 0: all_reduce in this stand-in) and it completed
    r0.synchronize()  # nothing from rank 1 yet: nothing raised
    assert not r0._err.any()
    r1.reject(4, "broadcast", "broadcast: out has dtype torch.float16")
    with pytest.raises(PurlinRejectedError) as err:
        r0.synchronize()
    e = err.value
    assert e.rank == 1 and e.cause == "broadcast: out has dtype torch.float16" and "call #4" in str(e)
    assert r0.resync_pending == ("all_reduce", 4) and not r0.broken
    r2 = _engines(2, monkeypatch)[2][0]
    r2._last = (5, 0)  # its last call is #5: the marks of #4 in its workspace belong to an earlier one
    ws2 = r2.ws.tensors[0]
    ws2[dl.desc(1, 4) // 8: dl.desc(1, 4) // 8 + 3] = cuda_mod.desc_word(4, cuda_mod.REJECT_MARK)
    r2.synchronize()
    assert not r2._err.any()


def _scribble(ws, dl, rng):
    """Every rank's workspace filled with non-zero words (the state a call left, stopped mid-way); a reset
    must clear the protocol state and the packet windows, and leave the staging payload."""
    for t in ws.tensors:
        t.copy_(torch.randint(1, 1 << 40, t.shape, generator=rng, dtype=torch.int64))
        t[dl.resync_off // 8: dl.signal_bytes // 8] = 0  # a new workspace's reset words


def _resync_all(engines_, seqs):
    """Every engine's resync(seq) at once, in threads (each polls its peers' reset words): (results, errors)."""
    out, errs = [None] * len(engines_), [None] * len(engines_)

    def run(i):
        try:
            out[i] = engines_[i].resync(seqs[i])
        except Exception as e:  # noqa: BLE001 - returned to the test
            errs[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines_))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errs


def test_the_reset_clears_every_ranks_protocol_state_and_agrees_on_the_call_number(monkeypatch):
    ws, dl, engs = _engines(3, monkeypatch)
    rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(2):  # twice: rounds count up, a second reset works as the first
        _scribble(ws, dl, rng)
        staged = [t[dl.staging_off // 8: dl.window_off // 8].clone() for t in ws.tensors]
        engs[1].reject(7, "all_gather", "all_gather: bad")
        for e in (engs[0], engs[2]):
            e._err[:] = 0
            assert _kernel_waits_for(e, 1, 7, fp=1)
            with pytest.raises(PurlinRejectedError):
                e.check()
        # rank 2 had enqueued one call more before it raised: every rank continues from 8
        got, errs = _resync_all(engs, [7, 7, 8])
        assert errs == [None] * 3 and got == [8, 8, 8], (got, errs)
        for t, before in zip(ws.tensors, staged):
            for at, n in dl.reset_spans():
                assert not t[at // 8: (at + n) // 8].any()
            assert torch.equal(t[dl.staging_off // 8: dl.window_off // 8], before)  # payload left alone
        for e in engs:
            assert e.resync_pending is None and not e.broken and not e._err.any()
            e.check()  # nothing recorded, nothing owed: the next call launches
            engines.check_usable("all_gather", e, None)


def test_a_rank_that_never_comes_to_the_reset_breaks_it_naming_that_rank(monkeypatch):
    ws, dl, (r0, r1) = _engines(2, monkeypatch)
    for e in (r0, r1):
        e.timeout_s = 0.3
    r1.reject(2, "all_reduce", "all_reduce: bad op")
    t0 = time.monotonic()
    with pytest.raises(PurlinTimeoutError) as err:
        r1.resync(2)  # rank 0 never raises, so never comes
    assert 0.3 <= time.monotonic() - t0 < 5
    e = err.value
    assert e.missing == (0,) and "rank 1 waited 0.3s (timeout_s) for its peers to reset (rank 0 did not come" in str(e)
    assert r1.broken and "broken" in str(e)
    with pytest.raises(PurlinBrokenError):
        engines.check_usable("all_reduce", r1, None)


def test_a_raised_rejection_is_not_pending_and_the_next_call_resets_first(monkeypatch):
    """The communicator's usability check (every call's first step) runs an owed reset before anything else
    and continues from the call number it returns; a reset that fails breaks the communicator."""
    from purlin_sglang.api import Communicator

    ws, dl, (r0, r1) = _engines(2, monkeypatch)
    r1.reject(5, "all_reduce", "bad")
    _kernel_waits_for(r0, 1, 5, fp=2)
    with pytest.raises(PurlinRejectedError):
        r0.check()
    assert r0.recorded_error() is None and r0.resync_pending == ("all_reduce", 5)  # raised: nothing pending
    r0.check()  # raised once; not broken
    assert not r0.broken

    released = []
    comms = []
    for e, seq in ((r0, 5), (r1, 6)):
        c = Communicator.__new__(Communicator)
        c._closed, c._engine, c._moe, c._seq, c._broken_reason = False, e, None, seq, None
        c.device = torch.device("cpu")
        c._release_broken = lambda c=c: released.append(c)
        comms.append(c)
    comms[1]._check_usable("synchronize")  # makes no call: no reset there (a rank may then wait for its peers)
    assert r1.resync_pending == ("all_reduce", 5)
    errs = []
    threads = [threading.Thread(target=lambda c=c: errs.append(c._check_usable("all_gather"))) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errs == [None, None] and [c._seq for c in comms] == [6, 6] and not released
    assert r0.resync_pending is None is r1.resync_pending and not r0._err.any()

    r1.timeout_s = 0.2
    r1.reject(7, "all_reduce", "bad again")
    c = comms[1]
    with pytest.raises(PurlinTimeoutError):  # rank 0 never comes
        c._check_usable("all_reduce")
    assert released == [c] and r1.broken


def test_a_long_message_is_cut_and_marked(monkeypatch):
    ws, dl, (r0, r1) = _engines(2, monkeypatch)
    r0.reject(3, "all_gather", "x" * 2000)
    _kernel_waits_for(r1, 0, 3, fp=1)
    with pytest.raises(PurlinRejectedError) as err:
        r1.check()
    assert err.value.cause == "x" * (8 * (REJECT_WORDS - 2)) + " [...]"


def test_an_ordinary_mismatch_stays_a_mismatch(monkeypatch):
    ws, dl, (r0, r1) = _engines(2, monkeypatch)
    w = ws.tensors[1]
    slot = dl.desc(0, 4) // 8
    w[slot] = cuda_mod.desc_word(4, 0x55)  # rank 0 is in call 4 with another fingerprint
    assert _kernel_waits_for(r1, 0, 4, fp=0x66)
    with pytest.raises(PurlinMismatchError):
        r1.check()


@pytest.mark.parametrize("call_check,fail", [(False, False), (True, True)], ids=["check-off", "copy-fails"])
def test_reject_never_raises_and_breaks_the_rank_even_when_it_cannot_tell_its_peers(monkeypatch, call_check, fail):
    ws, dl, (r0, r1) = _engines(2, monkeypatch, call_check=call_check, fail=fail)
    r0.reject(2, "all_reduce", "bad op")
    assert r0.broken and not ws.tensors[1].any()
    assert not _kernel_waits_for(r1, 0, 2, fp=9)  # nothing to meet: the peer would time out, as before
    with pytest.raises(PurlinBrokenError):
        engines.check_usable("all_reduce", r0, None)
