"""A Python model of native/moe/moe_kernel.cuh, standing in for the native library on CPU.

It reads the SAME PurlinMoeParams the CUDA engine fills (purlin_sglang/moe/cuda.py) and
follows the kernels step by step (put rows, count words, wait, expand, padding; put back, done
words, wait, reduce; the one-pass mode's steps; the decode mode's packets, 16 bytes each with the
epoch twice, into the windows the layout names) over raw addresses of CPU tensors, so the
engine's glue (parameters, layout, modes, errors) and the protocol are checked without a GPU. Each
rank's "kernel" runs in its rank's thread; waits spin with a timeout like the device's.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from purlin_sglang.moe.routing import quantize_fp8, route, send_positions

K_DISP_EPOCH, K_COMB_EPOCH, K_FATAL = 0, 1, 6
REJECT_BIT = 1 << 62
DECODE_META = 1 << 60  # encoding.h kDecodeMeta
PTR_WORDS = 16  # native.h PURLIN_MOE_PTR_WORDS
_DT = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
_ESIZE = {1: 2, 2: 2, 3: 4}


def arr(ctype, addr, n):
    return np.ctypeslib.as_array((ctype * max(n, 1)).from_address(addr))[:n]


def i64(addr, n=1):
    return arr(ctypes.c_int64, addr, n)


def i32(addr, n=1):
    return arr(ctypes.c_int32, addr, n)


def i8(addr, n=1):
    return arr(ctypes.c_uint8, addr, n)


def f32(addr, n=1):
    return arr(ctypes.c_float, addr, n)


class FakeMoELib:
    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self.launches = []

    def moe_occupancy(self, device=-1):
        self.device = device
        return 2, 132

    def error_string(self, code):
        return f"fake error {code}"

    def copy_atom(self, dst, src, nbytes, stream, max_blocks=0, device=-1):
        ctypes.memmove(dst, src, nbytes)

    # -- helpers --------------------------------------------------------------------------------------
    @staticmethod
    def _record(p, code, kind, peer, expert, count, cap, epoch, seen, fatal):
        st = i64(p.bases[p.rank] + p.state_off, 16)
        if fatal:
            if st[K_FATAL]:
                return
            st[K_FATAL] = 1
        h = i64(p.host_error, 16)
        if h[0]:
            return
        h[1:9] = (kind, p.rank, peer, expert, count, cap, epoch, seen)
        h[0] = code

    def _wait(self, p, addr, target, kind, peer, per_call=1):
        t0 = time.monotonic()
        while int(i64(addr)[0]) & ~REJECT_BIT < target:
            if i64(p.bases[p.rank] + p.state_off, 16)[K_FATAL]:
                return False
            if time.monotonic() - t0 > self.timeout_s:
                self._record(p, 1, kind, peer, -1, 0, 0, target // per_call, int(i64(addr)[0]) // per_call, True)
                return False
            time.sleep(0)
        return True

    @staticmethod
    def _cw(p, rank, par, producer):
        return p.bases[rank] + p.count_off + (par * p.world + producer) * p.count_bytes

    @staticmethod
    def _meta(p):
        return (p.payload_bytes << 24) | (p.topk << 16) | p.local

    def _count_words_out(self, p, r, par, e):
        """My count word to every rank, every call; the epoch last."""
        counts, tokens_to, l_ = r.counts.numpy(), r.tokens_to.numpy(), p.local
        for d in range(p.world):
            cw = self._cw(p, d, par, p.rank)
            i64(cw, 3)[1:3] = (tokens_to[d], self._meta(p))
            i32(cw + 24, l_)[:] = counts[d * l_:(d + 1) * l_]
        for d in range(p.world):
            i64(self._cw(p, d, par, p.rank))[0] = e

    @staticmethod
    def _ptr(p, rank, par):  # a rank's pointer block (PURLIN_MOE_PTR_WORDS words)
        return i64(p.bases[rank] + p.ptr_off + par * PTR_WORDS * 8, PTR_WORDS)

    @staticmethod
    def _begin(p, epoch_word):
        """A kernel's start: (state words, this call's epoch, parity), or None where an earlier error ended
        this rank's kernels (then the epoch is spent at once)."""
        st = i64(p.bases[p.rank] + p.state_off, 16)
        e = int(st[epoch_word]) + 1
        if st[K_FATAL]:
            st[epoch_word] = e
            return None
        return st, e, e & 1

    @staticmethod
    def _route(p):
        """The kernel's route step, in torch: my ids and their routing; writes out_valid."""
        t_n, k_ = p.tokens, p.topk
        ids = (i32 if p.ids_bytes == 4 else i64)(p.ids, t_n * k_).astype(np.int64) if t_n else np.zeros(0, np.int64)
        r = route(torch.from_numpy(ids).view(t_n, k_), p.local * p.world, p.world)
        if t_n:
            i8(p.out_valid, t_n * k_)[:] = r.valid.reshape(-1).numpy()
        return ids, r

    def _shapes_agree(self, p, par, e):
        """Every producer's count word names my rows' shape; a MISMATCH (fatal) is recorded where not."""
        for q in range(p.world):
            seen = int(i64(self._cw(p, p.rank, par, q), 3)[2])
            if seen != self._meta(p):
                self._record(p, 4, 0, q, -1, seen, self._meta(p), e, 0, True)
                return False
        return True

    def _receive_counts(self, p, cnt, ids, e):
        """cnt[q, le]: rows producer q routed to my expert le. Records an overflow and ids out of range,
        writes out_counts; returns the valid rows per local expert."""
        cap, l_ = p.capacity, p.local
        tot = np.minimum(cnt, cap).sum(0)
        over = np.argwhere(cnt > cap)
        if len(over):
            q, c = (int(v) for v in over[0])
            self._record(p, 2, 0, q, p.rank * l_ + c, int(cnt[q, c]), cap, e, 0, False)
        n_bad = int(((ids < -1) | (ids >= l_ * p.world)).sum())
        if n_bad > 0:
            self._record(p, 3, 0, -1, -1, n_bad, 0, e, 0, False)
        i32(p.out_counts, l_)[:] = tot
        return tot

    @staticmethod
    def _pad(p, tot):
        """Rows past each group's valid rows: expert, source and slot -1, scale 1."""
        group = p.world * p.capacity
        rows = p.local * group
        out_expert, out_src, out_slot = i32(p.out_expert, rows), i32(p.out_src, rows), i64(p.out_slot, rows)
        out_scales = f32(p.out_scales, rows) if p.out_scales else None
        for r in range(rows):
            if r % group >= tot[r // group]:
                out_expert[r] = out_src[r] = out_slot[r] = -1
                if out_scales is not None:
                    out_scales[r] = 1.0

    # -- a token's receive slot, shared by the receive-slot and decode paths ---------------------------
    @staticmethod
    def _slot_header(p, t, d, dst, le, j, scales):
        """Token t's slot header for destination d: [t, local expert per k, j per k, scale bits] (-1 for
        the slots that are not d's), padded to hdr_bytes."""
        k_ = p.topk
        h = np.zeros(p.hdr_bytes // 4, dtype=np.int32)
        h[0] = t
        h[1 + 2 * k_] = np.float32(float(scales[t]) if scales is not None else 1.0).view(np.int32)
        for k in range(k_):
            mine = dst[t * k_ + k] == d
            h[1 + k] = le[t * k_ + k] if mine else -1
            h[1 + k_ + k] = j[t * k_ + k] if mine else -1
        return h

    @staticmethod
    def _expand_slot(p, q, h, payload_addr, off):
        """Producer q's received slot (header ``h``, payload at ``payload_addr``) to one row per k routed
        here under capacity, with its expert, source, slot and scale."""
        w_, k_, cap = p.world, p.topk, p.capacity
        rows = p.local * w_ * cap
        for k in range(k_):
            lev, jj = int(h[1 + k]), int(h[1 + k_ + k])
            if lev < 0 or jj >= cap:
                continue
            row = lev * w_ * cap + int(off[q, lev]) + jj
            ctypes.memmove(p.out_x + row * p.payload_bytes, payload_addr, p.payload_bytes)
            i32(p.out_expert, rows)[row], i32(p.out_src, rows)[row] = lev, q
            i64(p.out_slot, rows)[row] = int(h[0]) * k_ + k
            if p.out_scales:
                f32(p.out_scales, rows)[row] = np.int32(h[1 + 2 * k_]).view(np.float32)

    # -- the decode mode: flag-in-data packets --------------------------------------------------------
    @staticmethod
    def _put_packets(addr, payload, e):
        """``payload`` (bytes, a multiple of 8) as packets {lo, epoch, hi, epoch} at ``addr``."""
        pay = np.frombuffer(bytes(payload), dtype=np.uint32).reshape(-1, 2)
        words = np.empty((len(pay), 4), dtype=np.uint32)
        words[:, 0], words[:, 2] = pay[:, 0], pay[:, 1]
        words[:, 1] = words[:, 3] = e & 0xFFFFFFFF
        ctypes.memmove(addr, words.ctypes.data, words.nbytes)

    def _take_packets(self, p, addr, n, e, kind, peer, other=None):
        """Wait until the ``n`` packets at ``addr`` carry epoch ``e``; their payload bytes, or None (a
        timeout recorded, or a fatal error). ``other``: the peer's count word here; its epoch ``e`` says
        the peer took the other mode (a MISMATCH, fatal)."""
        t0 = time.monotonic()
        while True:
            w = arr(ctypes.c_uint32, addr, 4 * n).reshape(n, 4).copy()
            if ((w[:, 1] == (e & 0xFFFFFFFF)) & (w[:, 3] == (e & 0xFFFFFFFF))).all():
                return w[:, [0, 2]].copy().tobytes()
            if i64(p.bases[p.rank] + p.state_off, 16)[K_FATAL]:
                return None
            if other is not None and int(i64(other)[0]) == e:
                self._record(p, 4, kind, peer, -1, int(i64(other, 3)[2]), self._meta(p) | DECODE_META, e, 0, True)
                return None
            if time.monotonic() - t0 > self.timeout_s:
                self._record(p, 1, kind, peer, -1, 0, 0, e, int(w[0, 1]), True)
                return None
            time.sleep(0)

    @staticmethod
    def _dwin(p, owner, par, producer):
        return p.bases[owner] + p.win_off + (par * p.world + producer) * p.win_bytes

    @staticmethod
    def _rwin(p, owner, par):
        return p.bases[owner] + p.rwin_off + par * p.rwin_parity_bytes

    def _dispatch_decode(self, p):
        """The decode mode (moe_kernel.cuh): header and token slots as packets into every receiver's
        window for me, then mine polled and expanded."""
        self.launches.append(("dispatch-decode", p.blocks))
        w_, k_, l_, cap, me, t_n = p.world, p.topk, p.local, p.capacity, p.rank, p.tokens
        assert t_n <= p.decode_tokens and 2 * p.count_bytes + p.decode_tokens * 2 * p.slot_bytes <= p.win_bytes
        assert p.win_off + 2 * w_ * p.win_bytes <= p.rwin_off
        begun = self._begin(p, K_DISP_EPOCH)
        if begun is None:
            return 0
        st, e, par = begun
        for d in range(w_):  # the delivered words count decode calls too (block 0 adds blocks, waits for none)
            i64(p.bases[d] + p.ddone_off + 8 * me)[0] += p.blocks
        ids, r = self._route(p)
        dst, le, j = (a.reshape(-1).numpy() for a in (r.dst, r.le, r.j))
        if t_n:
            ref = i64(p.out_ref, t_n * k_)
            for i in range(t_n * k_):
                ref[i] = int(dst[i]) << 32 | int(j[i]) if dst[i] >= 0 else -1
        x, scales = self._wire_rows(p, t_n)
        counts, tokens_to = r.counts.numpy(), r.tokens_to.numpy()
        meta = self._meta(p) | DECODE_META
        hp = (4 + l_ + 1) // 2
        for d in range(w_):
            words = np.zeros(2 * hp, dtype=np.int64)
            words[:4] = (tokens_to[d], 0, meta & 0xFFFFFFFF, meta >> 32)
            words[4:4 + l_] = counts[d * l_:(d + 1) * l_]
            self._put_packets(self._dwin(p, d, par, me), words.astype(np.uint32).tobytes(), e)
        send_pos = send_positions(r.to_rank).reshape(-1).numpy()
        for t in range(t_n):
            for d in range(w_):
                pos = int(send_pos[t * w_ + d])
                if pos < 0:
                    continue
                h = self._slot_header(p, t, d, dst, le, j, scales)
                row = x[t * p.payload_bytes:(t + 1) * p.payload_bytes].tobytes()
                self._put_packets(self._dwin(p, d, par, me) + 2 * p.count_bytes + pos * 2 * p.slot_bytes,
                                  h.tobytes() + row, e)
        heads = [self._take_packets(p, self._dwin(p, me, par, q), hp, e, 2, q, self._cw(p, me, par, q))
                 for q in range(w_)]
        ok = all(h is not None for h in heads)
        if ok:
            hw = [np.frombuffer(h, dtype=np.int32) for h in heads]
            for q in range(w_):
                seen = int(np.uint32(hw[q][2])) | int(hw[q][3]) << 32
                if seen != meta or hw[q][0] > p.decode_tokens:
                    self._record(p, 4, 0, q, -1, seen, meta, e, int(hw[q][0]), True)
                    ok = False
                    break
        if ok:
            cnt = np.stack([hw[q][4:4 + l_] for q in range(w_)]).astype(np.int64)
            off = np.cumsum(np.minimum(cnt, cap), 0) - np.minimum(cnt, cap)
            self._pad(p, self._receive_counts(p, cnt, ids, e))
            for q in range(w_):
                for i in range(int(hw[q][0])):
                    slot = self._dwin(p, me, par, q) + 2 * p.count_bytes + i * 2 * p.slot_bytes
                    data = self._take_packets(p, slot, p.slot_bytes // 8, e, 2, q)
                    if data is None:
                        break
                    payload = np.frombuffer(data[p.hdr_bytes:], dtype=np.uint8)
                    self._expand_slot(p, q, np.frombuffer(data[:p.hdr_bytes], dtype=np.int32), payload.ctypes.data, off)
        st[K_DISP_EPOCH] = e
        return 0

    @staticmethod
    def _reduce(p, slots):
        """y[t] = sum of w[t, k] * row over ``slots(t)`` (its (k, row bytes) in k order), float32, rounded
        once to y's dtype: the kernels' reduce for the one-pass and decode combines."""
        dt = _DT[p.dtype]
        n = p.ret_bytes // torch.empty(0, dtype=dt).element_size()
        w = torch.from_numpy(f32(p.weights, p.tokens * p.topk).copy()).view(p.tokens, p.topk)
        acc = torch.zeros(p.tokens, n, dtype=torch.float32)
        for t in range(p.tokens):
            for k, data in slots(t):
                acc[t] = acc[t] + w[t, k] * torch.frombuffer(bytearray(data), dtype=dt).to(torch.float32)
        out = acc.to(dt).contiguous().view(torch.uint8).numpy()
        ctypes.memmove(p.y, out.ctypes.data, out.nbytes)

    def _combine_decode(self, p):
        """The decode combine: a header packet to every rank, each valid row back as packets into slot
        t * K + k of its source's return window; then every header polled and my slots reduced."""
        self.launches.append(("combine-decode", p.blocks))
        w_, k_, me, cap = p.world, p.topk, p.rank, p.capacity
        head = -(-16 * w_ // 128) * 128
        assert head + p.decode_tokens * k_ * 2 * p.ret_bytes <= p.rwin_parity_bytes
        begun = self._begin(p, K_COMB_EPOCH)
        if begun is None:
            return 0
        st, e, par = begun
        for q in range(w_):
            self._put_packets(self._rwin(p, q, par) + 16 * me, np.array([p.reject, cap], dtype=np.uint32).tobytes(), e)
            i64(p.bases[q] + p.done_off + me * 8)[0] += p.blocks  # the done words count decode calls too
        if not p.reject:
            counts = i32(p.row_counts, p.local)
            rows = p.local * w_ * cap
            src, slot = i32(p.row_src, rows), i64(p.row_slot, rows)
            for lev in range(p.local):
                for i in range(int(counts[lev])):
                    row = lev * w_ * cap + i
                    raw = bytes((ctypes.c_char * p.ret_bytes).from_address(p.expert_out + row * p.ret_bytes))
                    self._put_packets(self._rwin(p, int(src[row]), par) + head + int(slot[row]) * 2 * p.ret_bytes, raw, e)
        ok, caps = True, [0] * w_
        for q in range(w_):
            h = self._take_packets(p, self._rwin(p, me, par) + 16 * q, 1, e, 3, q)
            if h is None:
                ok = False
                continue
            rejected, caps[q] = (int(v) for v in np.frombuffer(h, dtype=np.uint32))
            if q != me and rejected:
                self._record(p, 5, 1, q, -1, 0, 0, e, 0, False)
                ok = False
        if ok and not p.reject and p.tokens:
            ref = i64(p.row_ref, p.tokens * k_)

            def slots(t):
                for k in range(k_):
                    rf = int(ref[t * k_ + k])
                    if rf < 0 or (rf & 0xFFFFFFFF) >= caps[rf >> 32]:
                        continue  # not routed, or over its receiver's capacity: not delivered
                    data = self._take_packets(p, self._rwin(p, me, par) + head + (t * k_ + k) * 2 * p.ret_bytes,
                                              p.ret_bytes // 8, e, 3, rf >> 32)
                    if data is None:
                        return  # a timeout (recorded): the token's remaining slots are not read
                    yield k, data

            self._reduce(p, slots)
        st[K_COMB_EPOCH] = e
        return 0

    # -- dispatch -------------------------------------------------------------------------------------
    def moe_dispatch(self, pref, stream):
        p = pref._obj
        if p.decode:
            return self._dispatch_decode(p)
        if p.one_pass:
            return self._dispatch_one_pass(p)
        self.launches.append(("dispatch", p.blocks))
        w_, k_, l_, cap, me, t_n = p.world, p.topk, p.local, p.capacity, p.rank, p.tokens
        begun = self._begin(p, K_DISP_EPOCH)
        if begun is None:
            return 0
        st, e, par = begun
        ids, r = self._route(p)
        dst, le, j = (a.reshape(-1).numpy() for a in (r.dst, r.le, r.j))
        send_pos = send_positions(r.to_rank).reshape(-1).numpy()
        x, scales = self._wire_rows(p, t_n)
        for it in range(t_n * w_):
            t, d = it // w_, (it % w_ + me + 1) % w_
            pos = int(send_pos[t * w_ + d])
            if pos < 0:
                continue
            slot = p.bases[d] + p.recv_off + par * p.recv_parity_bytes + (me * p.max_tokens + pos) * p.slot_bytes
            i32(slot, p.hdr_bytes // 4)[:] = self._slot_header(p, t, d, dst, le, j, scales)
            ctypes.memmove(slot + p.hdr_bytes, x[t * p.payload_bytes:].ctypes.data, p.payload_bytes)
        self._count_words_out(p, r, par, e)
        for d in range(w_):  # every block adds one (arrive_all)
            i64(p.bases[d] + p.ddone_off + 8 * me)[0] += p.blocks
        ok = all(self._wait(p, self._cw(p, me, par, q), e, 0, q) and
                 self._wait(p, p.bases[me] + p.ddone_off + 8 * q, e * p.blocks, 0, q, p.blocks)
                 for q in range(w_)) and self._shapes_agree(p, par, e)
        if ok:
            cnt = np.stack([i32(self._cw(p, me, par, q) + 24, l_) for q in range(w_)]).astype(np.int64)
            ntok = [int(i64(self._cw(p, me, par, q), 2)[1]) for q in range(w_)]
            off = np.cumsum(np.minimum(cnt, cap), 0) - np.minimum(cnt, cap)
            tot = self._receive_counts(p, cnt, ids, e)
            recv = p.bases[me] + p.recv_off + par * p.recv_parity_bytes
            for q in range(w_):
                for i in range(ntok[q]):
                    slot = recv + (q * p.max_tokens + i) * p.slot_bytes
                    self._expand_slot(p, q, i32(slot, 2 * k_ + 2), slot + p.hdr_bytes, off)
            self._pad(p, tot)
        st[K_DISP_EPOCH] = e
        return 0

    def _wire_rows(self, p, t_n):
        """Token rows as they travel (FP8-quantised when p.quant) and their scales."""
        row_bytes = p.payload_bytes * (_ESIZE[p.x_dtype] if p.quant else 1)
        x = (torch.frombuffer(bytearray((ctypes.c_char * (t_n * row_bytes)).from_address(p.x)), dtype=torch.uint8)
             if t_n else torch.zeros(0, dtype=torch.uint8))
        scales = None
        if p.quant and t_n:
            q, scales = quantize_fp8(x.view(_DT[p.x_dtype]).view(t_n, p.payload_bytes))
            x = q.view(torch.uint8).reshape(-1)
        return x.contiguous().numpy(), scales

    def _dispatch_one_pass(self, p):
        """The one-pass mode (moe_kernel.cuh): rows straight into each receiver's outputs."""
        self.launches.append(("dispatch-one-pass", p.blocks))
        w_, k_, l_, cap, me, t_n = p.world, p.topk, p.local, p.capacity, p.rank, p.tokens
        begun = self._begin(p, K_DISP_EPOCH)
        if begun is None:
            return 0
        st, e, par = begun
        ids, r = self._route(p)
        dst, le, j = (a.reshape(-1).numpy() for a in (r.dst, r.le, r.j))
        self._ptr(p, me, par)[:6] = (p.out_x, p.out_expert, p.out_src, p.out_slot, p.out_scales or 0, cap)
        self._count_words_out(p, r, par, e)
        ok = all(self._wait(p, self._cw(p, d, par, q), e, 0, q) for d in range(w_) for q in range(w_))
        ok = ok and self._shapes_agree(p, par, e)
        if ok:
            x, scales = self._wire_rows(p, t_n)
            caps = [int(self._ptr(p, d, par)[5]) for d in range(w_)]
            cnt = {(d, q): i32(self._cw(p, d, par, q) + 24, l_).astype(np.int64) for d in range(w_) for q in range(w_)}
            ref = i64(p.out_ref, t_n * k_) if t_n else None
            for i in range(t_n * k_):
                ref[i] = -1
                d = int(dst[i])
                if d < 0 or j[i] >= caps[d]:
                    continue
                lev = int(le[i])
                off = sum(min(int(cnt[(d, q)][lev]), caps[d]) for q in range(me))
                row = lev * w_ * caps[d] + off + int(j[i])
                b = self._ptr(p, d, par)
                t = i // k_
                ctypes.memmove(int(b[0]) + row * p.payload_bytes, x[t * p.payload_bytes:].ctypes.data, p.payload_bytes)
                i32(int(b[1]) + 4 * row)[0], i32(int(b[2]) + 4 * row)[0], i64(int(b[3]) + 8 * row)[0] = lev, me, i
                if b[4]:
                    f32(int(b[4]) + 4 * row)[0] = float(scales[t]) if scales is not None else 1.0
                ref[i] = d << 32 | row
        for d in range(w_):  # every block adds one (arrive_all)
            i64(p.bases[d] + p.ddone_off + 8 * me)[0] += p.blocks
        if ok:
            self._pad(p, self._receive_counts(p, np.stack([cnt[(me, q)] for q in range(w_)]), ids, e))
            for q in range(w_):
                self._wait(p, p.bases[me] + p.ddone_off + 8 * q, e * p.blocks, 0, q, p.blocks)
        st[K_DISP_EPOCH] = e
        return 0

    def _combine_one_pass(self, p):
        self.launches.append(("combine-one-pass", p.blocks))
        w_, k_, me = p.world, p.topk, p.rank
        begun = self._begin(p, K_COMB_EPOCH)
        if begun is None:
            return 0
        st, e, par = begun
        mine = self._ptr(p, me, par)
        mine[9] = p.expert_out or 0
        mine[8] = e | (REJECT_BIT if p.reject else 0)
        ok = all(self._wait(p, p.bases[q] + p.ptr_off + (par * PTR_WORDS + 8) * 8, e, 1, q) for q in range(w_))
        for q in range(w_):
            if ok and q != me and int(self._ptr(p, q, par)[8]) & REJECT_BIT:
                self._record(p, 5, 1, q, -1, 0, 0, e, 0, False)
                ok = False
        if ok and not p.reject and p.tokens:
            eo = [int(self._ptr(p, q, par)[9]) for q in range(w_)]
            ref = i64(p.row_ref, p.tokens * k_)
            valid = i8(p.valid, p.tokens * k_)

            def slots(t):
                for k in range(k_):
                    rf = int(ref[t * k_ + k])
                    if valid[t * k_ + k] and rf >= 0:
                        yield k, (ctypes.c_char * p.ret_bytes).from_address(eo[rf >> 32] + (rf & 0xFFFFFFFF) * p.ret_bytes)

            self._reduce(p, slots)
        for q in range(w_):  # every block adds one (arrive_all)
            i64(p.bases[q] + p.done_off + me * 8)[0] += p.blocks
        for q in range(w_):
            self._wait(p, p.bases[me] + p.done_off + q * 8, e * p.blocks, 1, q, p.blocks)
        st[K_COMB_EPOCH] = e
        return 0

    # -- combine --------------------------------------------------------------------------------------
    def moe_combine(self, pref, stream):
        p = pref._obj
        if p.decode:
            return self._combine_decode(p)
        if p.one_pass:
            return self._combine_one_pass(p)
        self.launches.append(("combine", p.blocks))
        w_, k_, me = p.world, p.topk, p.rank
        begun = self._begin(p, K_COMB_EPOCH)
        if begun is None:
            return 0
        st, e, par = begun
        rows = p.local * w_ * p.capacity
        if not p.reject:
            src, slot = i32(p.row_src, rows), i64(p.row_slot, rows)
            for r in range(rows):
                q = int(src[r])
                if q < 0:
                    continue
                ctypes.memmove(p.bases[q] + p.ret_off + par * p.ret_parity_bytes + int(slot[r]) * p.ret_bytes,
                               p.expert_out + r * p.ret_bytes, p.ret_bytes)
        if p.reject:  # said before the done adds, in my pointer block's epoch word
            self._ptr(p, me, par)[8] = e | REJECT_BIT
        for q in range(w_):  # every block adds one (arrive_all)
            i64(p.bases[q] + p.done_off + me * 8)[0] += p.blocks
        ok = all(self._wait(p, p.bases[me] + p.done_off + q * 8, e * p.blocks, 1, q, p.blocks)
                 for q in range(w_)) and not p.reject
        for q in range(w_):
            if ok and q != me and int(self._ptr(p, q, par)[8]) == e | REJECT_BIT:
                self._record(p, 5, 1, q, -1, 0, 0, e, 0, False)
                ok = False
        if ok and p.tokens:
            dt = _DT[p.dtype]
            n = p.ret_bytes // torch.empty(0, dtype=dt).element_size()
            base = p.bases[me] + p.ret_off + par * p.ret_parity_bytes
            raw = (ctypes.c_char * (p.tokens * k_ * p.ret_bytes)).from_address(base)
            ret = torch.frombuffer(bytearray(raw), dtype=dt).view(p.tokens, k_, n)
            valid = torch.from_numpy(i8(p.valid, p.tokens * k_).copy()).view(p.tokens, k_) != 0
            w = torch.from_numpy(f32(p.weights, p.tokens * k_).copy()).view(p.tokens, k_)
            acc = torch.zeros(p.tokens, n, dtype=torch.float32)
            for k in range(k_):
                m = valid[:, k]
                acc[m] = acc[m] + w[m, k, None] * ret[m, k].to(torch.float32)
            out = acc.to(dt).contiguous().view(torch.uint8).numpy()
            ctypes.memmove(p.y, out.ctypes.data, out.nbytes)
        st[K_COMB_EPOCH] = e
        return 0
