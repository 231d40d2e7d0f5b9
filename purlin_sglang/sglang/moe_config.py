"""The ``moe:`` section of ``--purlin-config``: whether purlin is SGLang's MoE dispatcher.

```yaml
moe:
  dispatcher: purlin          # purlin | none (default: SGLang's own dispatcher, unchanged)
  max_tokens_per_rank: 256    # most tokens one rank dispatches in one call (its token shard)
  dtype: auto                 # auto (the hidden states' dtype) | bf16 | fp8 (float8_e4m3fn rows
                              # with per-token scales on the wire; experts get them dequantised)
```

Purlin is chosen only with ``--comm-backend purlin --purlin-config FILE`` whose ``moe.dispatcher`` is
``purlin``, and ``--moe-a2a-backend none`` (SGLang's list of a2a backends is closed). Where the
communicator's own config (``PurlinConfig``) has a ``moe`` field, that is read; otherwise the section
(``purlin_sglang.config.MoESettings``) is read; otherwise the section is read from the raw YAML here,
with the same keys.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import PurlinConfigError


class MoEDispatcherConfig(BaseModel):
    """What the ``moe:`` section holds (defaults: SGLang's own dispatcher): the keys of
    ``PurlinConfig.moe`` where that exists."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dispatcher: Literal["none", "purlin"] = "none"
    max_tokens_per_rank: int = Field(256, ge=1, le=1 << 20)
    dtype: Literal["auto", "bf16", "fp8"] = "auto"

    @property
    def purlin(self) -> bool:
        return self.dispatcher == "purlin"

    def torch_dtype(self):
        """The dtype rows travel in (None: the hidden states' own)."""
        import torch

        return {"auto": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[self.dtype]

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "moe") -> "MoEDispatcherConfig":
        if data is None:
            return cls()
        if isinstance(data, BaseModel):  # a PurlinConfig field of another model: same keys
            data = data.model_dump()
        if not isinstance(data, dict):
            raise PurlinConfigError(f"{source}: key 'moe': expected a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                key = "moe." + ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    lines.append(f"{source}: unknown key '{key}' (known: {', '.join(cls.model_fields)})")
                else:
                    lines.append(f"{source}: key '{key}': {err['msg']} (got {err.get('input')!r})")
            raise PurlinConfigError("; ".join(lines)) from None


def moe_config_of(plugin_config: Any = None, config_path: Optional[str] = None) -> MoEDispatcherConfig:
    """The ``moe:`` section: from the communicator config when it has the field, else the raw YAML."""
    purlin = getattr(plugin_config, "purlin", None)
    if purlin is not None and "moe" in type(purlin).model_fields:
        return MoEDispatcherConfig.from_dict(getattr(purlin, "moe"), source=f"--purlin-config {config_path}")
    if config_path is None:
        return MoEDispatcherConfig()
    return _from_yaml(str(config_path))


@functools.lru_cache(maxsize=16)
def _from_yaml(path: str) -> MoEDispatcherConfig:
    import yaml

    source = f"--purlin-config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise PurlinConfigError(f"{source}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PurlinConfigError(f"{source}: not valid YAML: {e}") from None
    data = data if isinstance(data, dict) else {}
    return MoEDispatcherConfig.from_dict(data.get("moe"), source=source)
