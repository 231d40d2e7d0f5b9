"""What SGLang says about routing that the neutral layer (:mod:`purlin_sglang.routed`) must be told:
whether it runs with deterministic inference."""

from __future__ import annotations

from ..routed.routing import env_on


def deterministic_inference() -> bool:
    """True when SGLang runs with ``--enable-deterministic-inference`` (it sets
    ``SGLANG_ENABLE_DETERMINISTIC_INFERENCE`` before any group exists; the variable alone counts too)."""
    return env_on("SGLANG_ENABLE_DETERMINISTIC_INFERENCE")
