"""A CUDA process group rank that rejects its own arguments (CudaEngine.reject), checked without a GPU:
two real CudaEngines whose workspaces are CPU tensors and whose library copies with memmove; the peer's
kernel is modelled by what native/snac/ops.cuh desc_differs does when a wait for the rejecting rank
stalls (read the descriptor slot, record a MISMATCH in the host record's format)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from purlin_sglang import engines, native
from purlin_sglang.engines import cuda as cuda_mod
from purlin_sglang.engines.base import fold32
from purlin_sglang.errors import PurlinBrokenError, PurlinMismatchError, PurlinRejectedError
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
    assert r1.broken and "rejected its arguments of call #7" in r1.broken
    # every peer's workspace: the message entry, then descriptor words 1-2, then word 0 (in that order)
    peers = [(q, ws.base_ptrs[q]) for q in (0, 2)]
    assert r1.lib.copies == ([(b + dl.reject(1), REJECT_WORDS * 8) for _, b in peers]
                             + [(b + dl.desc(1, seq) + 8, 16) for _, b in peers]
                             + [(b + dl.desc(1, seq), 8) for _, b in peers])
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
        assert f'rank 1 rejected its arguments of call #{seq}: "{message}"' in str(e) and "broken" in str(e)
        assert peer.broken
        peer.check()  # raised once: the next call's usability check says the communicator is broken
        with pytest.raises(PurlinBrokenError, match=f"all_reduce: the communicator is broken.*rank 1 rejected"):
            engines.check_usable("all_reduce", peer, None)


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
