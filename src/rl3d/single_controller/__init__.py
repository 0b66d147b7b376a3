"""The single-controller protocol every role speaks; a leaf: it imports no worker and no controller.

- `DataBatch`: what moves between the controller and the worker groups.
- `Dispatch`, `register`, `DispatchInfo`, `MODES`: how a worker method's input is split over
  ranks and its output collected, as (split, collect) pairs per mode.
- Worker-group backends with one `call(method, ...)` protocol: `SPMDWorkerGroup` (torchrun,
  every rank runs the controller) and `rl3d.single_controller.ray` (a driver and Ray actors).
- Resource pools (`Pool`) and backend services: `agree(flag)` for a stop request.
"""

from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import (
    INPUT_ROW,
    MODES,
    Dispatch,
    DispatchInfo,
    DispatchMode,
    merge_outputs,
    register,
)
from rl3d.single_controller.pools import Pool, hosting, pool_of
from rl3d.single_controller.spmd import SPMDWorkerGroup, agree

__all__ = [
    "INPUT_ROW",
    "MODES",
    "DataBatch",
    "Dispatch",
    "DispatchInfo",
    "DispatchMode",
    "Pool",
    "SPMDWorkerGroup",
    "agree",
    "hosting",
    "merge_outputs",
    "pool_of",
    "register",
]
