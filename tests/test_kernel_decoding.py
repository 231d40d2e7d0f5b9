"""The kernels decode op records only through the constants the load-time check compares.

native.load() compares purlin/encoding.h's named constants with purlin_sglang/abi.py; that guards the
kernels only if they read records through those names. This checks the kernel sources (comments
stripped) for a literal shift or mask of the record format: word 0's fields, a buffer reference's
fields and the descriptor word's call number. Needs no build and no GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from purlin_sglang import abi

NATIVE = Path(__file__).resolve().parents[1] / "native"
KERNEL_SOURCES = sorted((NATIVE / "snac").glob("*.cuh")) + [NATIVE / "api_snac.cu"]


def _code(text: str) -> str:
    """``text`` without its // and /* */ comments (string literals in kernels hold no code)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _literal(value: int, *, hex_only: bool = False) -> str:
    """A C integer literal of ``value``: decimal or hex (only hex: ``hex_only``), any suffix."""
    return rf"(?:{'' if hex_only else f'{value}|'}0x0*{value:x})(?:[uUlL]*)\b"


def literal_decodes(code: str, *, packet_format: bool = False) -> list[str]:
    """The literal shifts and masks of the record format in ``code``: shifts by a field's shift, masks
    by a field's mask (a hex literal: a mask of bits; a decimal one is a count, like a polling period),
    and the descriptor word's shift (not where ``packet_format``: a packet's two 32-bit halves are
    shifted by the same amount)."""
    shifts = {abi.SUB_SHIFT, abi.NSRC_SHIFT, abi.FLAGS_SHIFT, abi.REF_BUF_SHIFT, abi.REF_RANK_SHIFT,
              abi.REF_OFFSET_BITS} | (set() if packet_format else {abi.DESC_SEQ_SHIFT})
    masks = {abi.OPCODE_MASK, abi.SUB_MASK, abi.NSRC_MASK, (1 << abi.REF_RANK_BITS) - 1}
    found = []
    for v in sorted(shifts):
        found += re.findall(rf"(?:<<|>>)\s*{_literal(v)}", code, flags=re.I)
    for v in sorted(masks):
        found += re.findall(rf"&\s*{_literal(v, hex_only=True)}", code, flags=re.I)
    return found


def test_the_checker_finds_literal_decodes():
    assert literal_decodes("const int op = int((o[0] >> 8) & 0xff), k = int((o[0] >> 16) & 0xFF);") == \
        [">> 8", ">> 16", "& 0xff", "& 0xFF"]
    assert literal_decodes("int((u >> 48) & 0x3fff); u & ((1ull << 48) - 1); w0 >> 24; (seq << 32)") == \
        [">> 24", "<< 32", ">> 48", "<< 48", "& 0x3fff"]
    assert literal_decodes("uint64_t(v.z) << 32", packet_format=True) == []
    assert literal_decodes("(w0 >> kSubShift) & kSubMask; n & 63u; n & 255u; x & 15u; (8 * b)") == []
    assert literal_decodes("int x = 1; // w0 >> 8") == [">> 8"]  # comments are stripped by _code only
    assert literal_decodes(_code("int x = 1; // w0 >> 8 & 0xff")) == []


@pytest.mark.parametrize("path", KERNEL_SOURCES, ids=lambda p: p.name)
def test_kernels_decode_records_only_through_named_constants(path):
    found = literal_decodes(_code(path.read_text()), packet_format=path.name == "packet.cuh")
    assert not found, f"{path.name} decodes the op-record format with literals {found}; use the constants " \
                      "of purlin/encoding.h (snac/ops.cuh: opcode_of, sub_of, nsrc_of, ref_buf, ref_rank, ...)"


def test_the_decoders_use_the_exported_names():
    code = _code((NATIVE / "snac" / "ops.cuh").read_text())
    for name in ("kOpcodeMask", "kSubShift", "kSubMask", "kNsrcShift", "kNsrcMask", "kFlagsShift", "kRefBufShift",
                 "kRefRankShift", "kRefRankBits", "kRefOffsetBits", "kDescSeqShift"):
        assert name in code, name
    launch = _code((NATIVE / "api_snac.cu").read_text())
    assert "kKernelPacket" in launch and "kKernelStaged" in launch  # the kernel kind, from the ABI
