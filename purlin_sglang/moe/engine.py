"""The MoE engine contract: what an engine's MoE part provides and what the Communicator hands it.

Each engine has a MoE part (:class:`MoEEngine`: the CPU engine's :class:`~.cpu.CpuMoE`, the CUDA
engine's :class:`~.cuda.CudaMoE`), registered beside the engine (``engines.ENGINES``) and built by
``engines.create_moe(name, ctx)`` with a :class:`MoEContext`. The Communicator builds the context
once, when it starts; it is all a MoE part sees of the Communicator: which rank and world, the
device and the config, two of the communicator's own collectives, a way to mark the communicator
broken, and where the CUDA part's region comes from. A MoE part never holds the Communicator.

Every eager dispatch starts with the count exchange (:class:`~.exchange.CountExchange`, over
``ctx.all_gather``): every rank learns every rank's call header and counts, so a bad call raises on
every rank and the communicator stays usable. A rank whose own arguments are bad joins that
exchange through :meth:`MoEEngine.reject`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..config import PurlinConfig
from .dispatch import MoEDispatch


@dataclass(frozen=True, eq=False)
class MoEContext:
    """What the Communicator hands its engine's MoE part (built once per Communicator).

    * ``rank``, ``world``, ``device``, ``config``: the communicator's.
    * ``owner``: identifies the communicator; the parts stamp it on each :class:`MoEDispatch`
      (``_owner``), and ``moe_combine`` refuses a dispatch another communicator made.
    * ``all_gather(t)``: the communicator's all_gather of a 1-D int64 tensor on ``device``, in rank
      order (collective): the count exchange's.
    * ``all_to_all_v(t, input_splits, output_splits)``: the communicator's (collective): the CPU
      part's rows.
    * ``mark_broken(reason)``: make every later call of the communicator fail with ``reason`` (a
      fatal error the device recorded: a timeout, ranks that disagree on the rows' shape).
    * ``ranks_on_gpu``: how many ranks' grids must be co-resident on this rank's GPU (the world for
      virtual ranks, 1 for a process group), as ``engines.create`` gets it.
    * ``memory``, ``group``: the device provider and the process group that make a process group's
      MoE region (``group`` is None for virtual ranks).
    * ``shared_regions``: the virtual world's :class:`~.region.SharedRegions` (one region for every
      virtual rank on one GPU), or None.
    """

    rank: int
    world: int
    device: torch.device
    config: PurlinConfig
    owner: int
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    all_to_all_v: Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor]
    mark_broken: Callable[[str], None]
    ranks_on_gpu: int = 1
    memory: str = ""
    group: Any = None
    shared_regions: Any = None


@runtime_checkable
class MoEEngine(Protocol):
    """One rank's MoE dispatch and combine over one engine, built with a :class:`MoEContext`.

    The Communicator has checked the arguments (:mod:`.validate`) and that it is usable before it
    calls :meth:`dispatch` or :meth:`combine`; both are collective. ``hbm_bytes``: device memory the
    part holds (its MoE region; 0 on the CPU).
    """

    hbm_bytes: int

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 capacity: Optional[int], quant: str, capturing: bool, max_tokens: Optional[int] = None) -> MoEDispatch:
        """Route this rank's tokens to their experts' ranks and return its expert rows. Eager calls
        (``capturing`` false) run the count exchange first; ``quant``: ``"none"`` or ``"fp8"``;
        ``max_tokens``: the most tokens any rank dispatches in this call (or None), which an engine may
        use to pick a mode every rank takes alike."""
        ...

    def combine(self, expert_out: torch.Tensor, d: MoEDispatch) -> torch.Tensor:
        """Send ``d``'s expert rows back and return the weighted sums [T, H] of this rank's tokens."""
        ...

    def reject(self, error: Exception) -> None:
        """An eager dispatch whose arguments this rank rejected: join the count exchange as a rejecting
        rank (the peers raise naming this rank) and raise ``error``."""
        ...

    def reject_combine(self, error: Exception) -> None:
        """A combine whose arguments this rank rejected: end the peers' combine of this call without a
        timeout (they raise, naming this rank: at once on the CPU engine, at their next check on CUDA) and
        raise ``error``. The communicator stays usable."""
        ...

    def check(self, fatal_only: bool = False) -> None:
        """Raise an error an earlier call recorded (no device sync); ``fatal_only``: only one that
        broke the communicator (the checks before every call)."""
        ...

    def synchronize(self) -> None:
        """Wait until this rank's MoE calls are done; raise an error one of them recorded."""
        ...

    def recorded_error(self) -> Optional[Exception]:
        """The error a kernel recorded that the next check raises, or None; changes nothing, waits for
        nothing, safe from another thread (the CPU engine: None)."""
        ...

    def trace(self) -> Optional[dict[str, dict[str, int]]]:
        """The phase stamps (ns, the GPU's clock) of this rank's last dispatch and combine, by kind and
        phase (``abi.MOE_TRACE_PHASES``), after waiting for them; None where the engine has no kernel
        phases or ``moe.trace`` is off."""
        ...

    def close(self) -> None:
        """Drop this part's region and references. Local; safe twice."""
        ...
