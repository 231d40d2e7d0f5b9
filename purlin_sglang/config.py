"""PurlinConfig: the one typed configuration of purlin_sglang.

Defaults are documented on each field. ``PurlinConfig.from_yaml(path)`` reads a
YAML mapping; unknown keys and bad values, there, in ``from_dict`` or given to the constructor,
are rejected with a :class:`~purlin_sglang.errors.PurlinConfigError` that names the key. No setting
of purlin's comes from the environment at run time (the framework adapters read the frameworks' own
deterministic-inference switches); the build reads ``PURLIN_CUDA_ARCHS``, ``PURLIN_DISABLE_CUDA``,
``PURLIN_WITH_NVSHMEM`` and ``PURLIN_NVSHMEM_DIR`` (CMakeLists.txt, native/CMakeLists.txt,
native/nvshmem/CMakeLists.txt).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, field_validator

from .config_model import ConfigModel, explain
from .errors import PurlinConfigError
from .memory import providers
from .snac.policy import TuningPolicy

MiB = 1024 * 1024


@dataclass(frozen=True)
class Timeouts:
    """Every bounded wait of purlin, derived from one ``timeout_s`` by :func:`timeouts`."""

    call_s: float  # a rank waiting for a peer inside a call: the CPU engine's deadline, the launch gate
    kernel_ns: int  # the same wait on the device (the CUDA kernels' bound)
    setup_s: float  # each set-up phase of a Communicator (the gloo monitored barriers)
    destroy_s: float  # the plugin's barrier before freeing a group's memory (at least 1 s)
    join_s: float  # run_virtual waiting for a rank thread: its calls' waits, set-up and teardown


def timeouts(timeout_s: float) -> Timeouts:
    """The one place where every wait's bound comes from ``timeout_s`` (PurlinConfig.timeout_s)."""
    return Timeouts(call_s=timeout_s, kernel_ns=int(timeout_s * 1e9), setup_s=timeout_s,
                    destroy_s=max(1.0, timeout_s), join_s=timeout_s * 4 + 60)


class MoESettings(ConfigModel):
    """The ``moe:`` section: expert-parallel dispatch and combine (``Communicator.moe_dispatch``).

    * ``dispatcher`` (``none``): ``purlin`` makes purlin SGLang's MoE dispatcher (the plugin reads it).
    * ``max_tokens_per_rank`` (256): most tokens one rank dispatches in one call on the CUDA engine;
      sizes the MoE region (see docs/DESIGN.md, "MoE") and is the default capacity (rows per
      source rank and local expert) of graph-mode calls.
    * ``dtype`` (``auto``): the dispatch payload for the SGLang dispatcher: ``auto`` (the activations'
      dtype), ``bf16`` or ``fp8`` (float8_e4m3fn rows with per-token float32 scales).
    * ``signal_scope`` (``auto``): the memory scope of the CUDA kernels' count and done words:
      ``auto`` is GPU scope where every rank's region lies on one GPU (virtual ranks) and system
      scope otherwise; ``system`` always takes system scope, as ranks on several GPUs need (to
      measure what that scope costs on one GPU).
    * ``one_pass`` (true): virtual ranks (one process, ``run_virtual``) exchange rows directly: a source
      writes each (token, expert) row once into the receiver's output and the combine reads each
      expert output where it lies (no receive slots, no return rows; the MoE region shrinks to a few
      KiB). false: the receive-slot path, which ranks in separate processes always take.
    * ``decode_tokens`` (0: off): the CUDA engine's decode mode (docs/DESIGN.md, "MoE"): a call in which
      every rank dispatches at most this many tokens moves its rows as flag-in-data packets, one round
      an op (no count, delivered or done words); at most 32. Off by default: on virtual ranks of one
      GPU it measured slower than the other modes (docs/RESULTS.md); ranks on separate GPUs, which it
      is meant for, have not been measured. Eager calls decide from
      the exchanged token counts; a captured call from ``moe_dispatch``'s ``max_tokens`` (default:
      this rank's tokens, so then every rank must be on the same side). Adds windows for this many
      tokens a rank to the MoE region (about 7 MiB at 8 tokens, top-8, hidden 7168, bf16, 8 ranks).
    * ``trace`` (false): the CUDA kernels stamp the end of each of their phases (the GPU's clock, ns)
      for ``Communicator.moe_trace()``: a diagnostic (one store per phase and call).
    """

    dispatcher: Literal["none", "purlin"] = "none"
    max_tokens_per_rank: int = Field(256, ge=1, le=1 << 20)
    dtype: Literal["auto", "bf16", "fp8"] = "auto"
    signal_scope: Literal["auto", "system"] = "auto"
    one_pass: bool = True
    decode_tokens: int = Field(0, ge=0, le=32)
    trace: bool = False


class TopologySettings(ConfigModel):
    """The ``topology:`` section: which node each rank of a group runs on, and what joins the nodes.

    * ``node_of_rank`` (unset): one node id (an int >= 0) per rank of the group, the same list on
      every rank; unset, the ranks' hosts decide (ranks on one host are one node). Set, it lets a
      test pretend a layout of nodes on one host.
    * ``inter_node`` (``auto``): the engine between nodes of a group that spans several
      (docs/MULTINODE.md): purlin runs inside each node and torch.distributed, on groups it creates,
      between them. ``auto``: NCCL for a CUDA communicator, gloo for a CPU one; ``nccl`` or ``gloo``:
      that backend; ``off``: a group on several nodes is refused at construction with an error that
      names the nodes. Every node must hold the same number of ranks of the group.
    """

    node_of_rank: Optional[tuple[int, ...]] = None
    inter_node: Literal["auto", "nccl", "gloo", "off"] = "auto"

    @field_validator("node_of_rank")
    @classmethod
    def _ids(cls, v):
        if v is not None and (not v or any(n < 0 for n in v)):
            raise ValueError("need one node id >= 0 per rank of the group")
        return v


class PurlinConfig(ConfigModel):
    """Configuration of a :class:`~purlin_sglang.Communicator`.

    * ``timeout_s`` (60): longest wait for a peer before ``PurlinTimeoutError``.
    * ``staging_bytes`` (64 MiB): staging buffer per rank; larger payloads cycle through it.
    * ``symmetric_bytes`` (0): a symmetric heap per rank after the staging buffer
      (``Communicator.symmetric_empty``): a collective whose input lies there, at the same offset on
      every rank, reads its peers' inputs in place instead of staging them (the ``direct`` plans).
      0: no heap. The workspace's staging region is then ``staging_bytes`` rounded up to 4 KiB plus
      this, and set-up errors about ranks that disagree quote that sum.
    * ``memory`` (``auto``): symmetric memory provider: ``auto`` or a provider of
      memory/providers.py (``ipc``, ``torch``, ``nvshmem``, ``loopback``, ``host``). ``auto`` is the
      engine's first: ``host`` on CPU, ``ipc`` for a CUDA process group, ``loopback`` for virtual ranks.
    * ``shm_dir`` (``/dev/shm``): where the CPU engine's shared workspace file of a process
      group is made (a tmpfs; the file is allocated for real and checked for space first).
    * ``deterministic`` (true): reductions in a fixed rank order, bitwise identical on
      every rank and run. Every engine of this version is deterministic; ``false`` is
      reserved for faster non-deterministic paths (none yet).
    * ``device_call_check`` (true): the CUDA engine's kernels publish a descriptor of every call
      to their peers and compare their peers' in their waits: ranks that made different calls at
      the same call number get a ``PurlinMismatchError`` naming both calls at once, instead of a
      ``PurlinTimeoutError`` after ``timeout_s``. Staged calls that differ but complete (equal
      bytes) are caught when the ranks do not enter them at the same instant; packet calls always,
      through the packets' signature (docs/DESIGN.md). Measured on the H200 (packet all_reduce in a
      graph, medians of 3 alternating rounds): 8 KiB at 8 ranks 6.59 us on, 6.61 off; at 1 and 2
      ranks +0.08 and +0.12 us; nothing visible on the staged one-shot. The same descriptors carry a
      rank's rejection of its own arguments to a process group's peers, which then reset the
      communicator's state with it and keep it usable. ``false`` makes a mismatch, and a peer's
      rejection, a timeout. The CPU engine and loopback eager calls always check.
    * ``split_check`` (true): a CUDA process group compares the ranks' ``all_to_all_v`` splits over
      its host (gloo) group before each such call (under graph capture: at capture, not per replay):
      splits that disagree (rank p sends n rows to q, q expects m from p) raise the same
      ``PurlinMismatchError`` on every rank, naming both arguments, before any row moves, and the
      communicator stays usable; a rank that rejects its own ``all_to_all_v`` arguments tells its
      peers there too (they raise ``PurlinRejectedError`` quoting it, and the communicator stays
      usable). Costs a host round trip per eager ``all_to_all_v`` (one gloo
      all-gather of a row of 2 x world + 33 integers per rank, its wait bounded by ``timeout_s``). ``false``: a disagreement
      is a short copy or a timeout. The CPU engine and loopback eager calls always check; groups whose
      backend is not gloo are not checked (their wait could not be bounded).
    * ``tuning``: the planner's :class:`~purlin_sglang.snac.TuningPolicy`.
    * ``moe``: :class:`MoESettings` (MoE dispatch and combine).
    * ``topology``: :class:`TopologySettings` (which node each rank runs on).
    """

    timeout_s: float = Field(60.0, gt=0, le=86400)
    staging_bytes: int = Field(64 * MiB, ge=4096, le=1 << 40)
    symmetric_bytes: int = Field(0, ge=0, le=1 << 40)
    memory: str = providers.AUTO
    shm_dir: str = Field("/dev/shm", min_length=1)
    deterministic: bool = True
    device_call_check: bool = True
    split_check: bool = True
    tuning: TuningPolicy = Field(default_factory=TuningPolicy)
    moe: MoESettings = Field(default_factory=MoESettings)
    topology: TopologySettings = Field(default_factory=TopologySettings)

    @field_validator("memory")
    @classmethod
    def _provider(cls, value: str) -> str:
        return providers.check_name(value)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "purlin config") -> "PurlinConfig":
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PurlinConfigError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PurlinConfigError(explain(e, source, cls)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "PurlinConfig":
        import yaml

        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise PurlinConfigError(f"purlin config {p}: cannot read: {e.strerror or e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PurlinConfigError(f"purlin config {p}: not valid YAML: {e}") from None
        return cls.from_dict(data, source=f"purlin config {p}")

    @property
    def timeouts(self) -> Timeouts:
        """The bound of every wait, from ``timeout_s`` (see :func:`timeouts`)."""
        return timeouts(self.timeout_s)

    def replace(self, **changes: Any) -> "PurlinConfig":
        """A copy with ``changes`` applied and validated."""
        return type(self).from_dict({**self.model_dump(), **changes})

