"""purlin_sglang: layout-named collectives, one SNAC planner, native atoms; an SGLang plugin.

Public names: :class:`Communicator`, :func:`run_virtual`, :class:`PurlinConfig`,
the error hierarchy (:class:`PurlinError` and subclasses), and the
:mod:`purlin_sglang.collectives` vocabulary for defining your own collectives.
Importing has no side effects: no device work, no compilation, no environment changes.
"""

from .api import Communicator, run_virtual
from .collectives import CATALOG, CollectiveSpec, Consume, Layout, ReduceOp
from .config import PurlinConfig
from .moe import MoEDispatch
from .errors import (
    PurlinBrokenError, PurlinCapacityError, PurlinClosedError, PurlinConfigError, PurlinError, PurlinMismatchError,
    PurlinPlanError, PurlinRejectedError, PurlinTimeoutError, PurlinTopologyError, PurlinUnavailableError,
    PurlinValueError,
)

__version__ = "0.1.0"

__all__ = [
    "Communicator", "run_virtual", "PurlinConfig", "CATALOG", "CollectiveSpec", "Consume", "Layout",
    "ReduceOp", "PurlinError", "PurlinValueError", "PurlinConfigError", "PurlinPlanError",
    "PurlinUnavailableError", "PurlinClosedError", "PurlinBrokenError", "PurlinTimeoutError",
    "PurlinMismatchError", "PurlinCapacityError", "PurlinRejectedError", "PurlinTopologyError", "MoEDispatch",
    "__version__",
]
