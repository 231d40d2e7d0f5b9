"""What SGLang says about routing that the neutral layer (:mod:`purlin_sglang.routed`) must be told:
whether it runs with deterministic inference."""

from __future__ import annotations

import os


def deterministic_inference() -> bool:
    """True when SGLang runs with ``--enable-deterministic-inference`` (it sets
    ``SGLANG_ENABLE_DETERMINISTIC_INFERENCE`` before any group exists; the variable alone counts too)."""
    return os.environ.get("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "").strip().lower() in ("1", "true", "yes", "on")
