"""The ``moe:`` section of ``--purlin-config`` as the SGLang MoE dispatcher reads it.

```yaml
moe:
  dispatcher: purlin          # purlin | none (default: SGLang's own dispatcher, unchanged)
  max_tokens_per_rank: 256    # most tokens one rank dispatches in one call (its token shard); on
                              # CUDA also the fixed rows per (source rank, local expert)
  dtype: auto                 # auto (the hidden states' dtype) | bf16 | fp8 (float8_e4m3fn rows
                              # with per-token scales on the wire; experts get them dequantised)
```

The keys are ``purlin_sglang.config.MoESettings`` (``PurlinConfig.moe``). Purlin is SGLang's MoE
dispatcher with ``--comm-backend purlin --moe-a2a-backend purlin`` (the plugin adds ``purlin`` to that
flag's choices; the limits come from this section when ``--purlin-config`` is given, else its defaults),
or with ``--comm-backend purlin --purlin-config FILE`` whose ``moe.dispatcher`` is ``purlin`` and
``--moe-a2a-backend none``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..config import MoESettings

WIRE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def moe_settings_of(plugin_config: Any) -> MoESettings:
    """The ``moe:`` section of a plugin config (``PluginConfig``) or a ``PurlinConfig``."""
    purlin = getattr(plugin_config, "purlin", plugin_config)
    return purlin.moe


def wire_dtype(settings: MoESettings) -> Optional[torch.dtype]:
    """The dtype rows travel in (None: the hidden states' own)."""
    return WIRE_DTYPES[settings.dtype]
