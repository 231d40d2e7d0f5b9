"""A plugin's configuration: a PurlinConfig plus the routing table (which ops, which sizes).

A YAML file (SGLang: ``--purlin-config PATH``) holds the keys of
:class:`~purlin_sglang.PurlinConfig` (``configs/purlin.yaml`` is one) and, optionally, a
``routing:`` section read here. Unknown keys are rejected with a message naming the key.

The routing decision of every op must be the same on every rank of a group (otherwise one
rank would enter purlin and its peers the framework's own path), so the size compared with the
thresholds is the group-wide payload: the larger of the op's input and output in bytes,
which every rank of the group agrees on (for the V forms: the sum over ranks).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from pydantic import Field, ValidationError

from ..config import PurlinConfig
from ..config_model import ConfigModel
from ..errors import PurlinConfigError
from ..memory import providers

MiB = 1024 * 1024

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_v", "reduce_scatter_v", "all_to_all")


class OpRoute(ConfigModel):
    """When one op goes to purlin: ``enabled`` and ``min_bytes <= payload <= max_bytes``."""

    enabled: bool = True
    min_bytes: int = Field(0, ge=0)
    max_bytes: int = Field(64 * MiB, ge=0)

    def admits(self, nbytes: int) -> bool:
        return self.enabled and self.min_bytes <= nbytes <= self.max_bytes


class RoutingTable(ConfigModel):
    """Per-op routes, and the framework's groups that get a purlin communicator at all.

    The byte limits are the configured defaults, not measured crossovers: purlin's CUDA
    engine has not been compared with NCCL (there has been no multi-GPU machine to do it
    on); they keep purlin to sizes its staging serves well.
    ``groups``: the group names (SGLang's ``GroupCoordinator(group_name=...)``) that get a
    purlin communicator, each with its own staging: by default the SGLang groups that carry the
    model's collectives; ``None`` = every group of more than one rank (also ``world``, ``pp``, ...).
    """

    all_reduce: OpRoute = OpRoute(max_bytes=8 * MiB)
    all_gather: OpRoute = OpRoute()
    reduce_scatter: OpRoute = OpRoute()
    all_gather_v: OpRoute = OpRoute()
    reduce_scatter_v: OpRoute = OpRoute()
    all_to_all: OpRoute = OpRoute()
    groups: Optional[tuple[str, ...]] = ("tp", "attention_tp", "moe_tp", "moe_ep")

    def route(self, op: str) -> OpRoute:
        return getattr(self, op)

    def covers(self, group_name: str) -> bool:
        return self.groups is None or group_name in self.groups


REDUCE_OPS = ("all_reduce", "reduce_scatter", "reduce_scatter_v")
UNBOUNDED = 1 << 62


def env_on(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1, true, yes or on (any case): how the
    frameworks' switches of deterministic (batch-invariant) inference are read."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def for_deterministic_inference(table: RoutingTable) -> tuple[RoutingTable, list[str]]:
    """The routing table under deterministic inference: every enabled reduce op admits every size.

    Every purlin algorithm accumulates in float32 in rank order, so a row's result is the same
    bitwise whatever the batch around it (tests/test_batch_invariance.py); a size threshold would
    send some batches to NCCL, whose reduction order follows its algorithm and chunking. An op the
    config switched off stays off (the user's choice; the framework's own deterministic path runs it).
    Returns the table and one line per op that changed or stayed off, for the log."""
    changes, notes = {}, []
    for op in REDUCE_OPS:
        r = table.route(op)
        if not r.enabled:
            notes.append(f"{op} stays off (routing.{op}.enabled: false)")
        elif r.min_bytes != 0 or r.max_bytes < UNBOUNDED:
            changes[op] = OpRoute(enabled=True, min_bytes=0, max_bytes=UNBOUNDED)
            notes.append(f"{op} every size (was {r.min_bytes}..{r.max_bytes} bytes)")
    return (table.model_copy(update=changes) if changes else table), notes


class PluginConfig(ConfigModel):
    """What a plugin config file holds: the communicator's config and the routing table."""

    purlin: PurlinConfig = Field(default_factory=PurlinConfig)
    routing: RoutingTable = Field(default_factory=RoutingTable)
    # Seconds between routing summaries in the log while serving (0: only at destroy, which a killed
    # server never reaches).
    report_interval_s: float = Field(0.0, ge=0)
    # Seconds between looks at the error a CUDA kernel of this rank recorded (Communicator.pending_error):
    # each logged once, as soon as it appears, also where no later call would raise it (decode graphs replay
    # no purlin call; the framework may fail elsewhere first). 0: off.
    error_watch_s: float = Field(0.5, ge=0)

    @classmethod
    def from_yaml(cls, path: str | Path, *, flag: str = "config") -> "PluginConfig":
        """The config in the YAML file ``path``; errors name it as ``{flag} {path}`` (SGLang's plugin
        passes ``--purlin-config``)."""
        import yaml

        p = Path(path)
        source = f"{flag} {p}"
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as e:
            raise PurlinConfigError(f"{source}: cannot read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise PurlinConfigError(f"{source}: not valid YAML: {e}") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "purlin plugin config") -> "PluginConfig":
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise PurlinConfigError(f"{source}: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        routing = data.pop("routing", None) or {}
        seconds = {}
        for key in ("report_interval_s", "error_watch_s"):
            v = data.pop(key, cls.model_fields[key].default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise PurlinConfigError(f"{source}: key '{key}': need seconds >= 0 (got {v!r})")
            seconds[key] = float(v)
        purlin = PurlinConfig.from_dict(data, source=source)
        providers.check_for_groups(purlin.memory, source)  # a serving framework's ranks are processes of a group
        try:
            table = RoutingTable.model_validate(routing)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                key = "routing." + ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    lines.append(f"{source}: unknown key '{key}' (known: {', '.join(RoutingTable.model_fields)}; "
                                 f"per op: {', '.join(OpRoute.model_fields)})")
                else:
                    lines.append(f"{source}: key '{key}': {err['msg']} (got {err.get('input')!r})")
            raise PurlinConfigError("; ".join(lines)) from None
        return cls(purlin=purlin, routing=table, **seconds)
