"""The limits one config puts on MoE calls, each decided here and nowhere else.

``moe.max_tokens_per_rank`` (:class:`~purlin_sglang.config.MoESettings`) sizes the CUDA engine's
MoE region (receive slots per producer, return rows per top-k slot; :mod:`.region`), so it bounds
the tokens one rank may dispatch in one call there, and it is the capacity of a fixed-rows call that
names none (CUDA graph capture; the SGLang dispatcher on CUDA). The CPU engine has no region and no
such bound. Whoever refuses a call over the bound (the CUDA engine's MoE part, the SGLang dispatcher
for its largest shard) asks :func:`token_excess`; whoever needs the default capacity asks
:func:`default_capacity`. The frameworks' dispatchers split a replicated batch into per-rank
shards with :func:`token_shard` and bound it by :func:`largest_shard`.
"""

from __future__ import annotations

from ..config import MoESettings


def token_excess(settings: MoESettings, tokens: int) -> str:
    """"" when one rank may dispatch ``tokens`` tokens in one call under ``settings`` (the ``moe:``
    section); else why not, as a phrase to end an error message with: ``more than
    moe.max_tokens_per_rank 256``."""
    limit = settings.max_tokens_per_rank
    return f"more than moe.max_tokens_per_rank {limit}" if tokens > limit else ""


def default_capacity(settings: MoESettings) -> int:
    """The rows per (source rank, local expert) of a fixed-rows call that names no capacity."""
    return settings.max_tokens_per_rank


def token_shard(tokens: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s token rows [lo, hi) of a batch of ``tokens`` replicated on ``ranks`` ranks, each
    dispatching its own shard (``torch.tensor_split`` order: the first ``tokens % ranks`` one longer)."""
    base, extra = divmod(tokens, ranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def largest_shard(tokens: int, ranks: int) -> int:
    """The most tokens one rank's :func:`token_shard` holds (every rank computes the same)."""
    return -(-tokens // ranks)
