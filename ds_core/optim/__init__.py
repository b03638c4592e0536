"""Optimizers DeepSpeed's configs name that torch does not ship: ``Lamb`` and the
communication-compressing ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb``.

Each reproduces DeepSpeed's update formulas (the module docstrings name DeepSpeed's file) with
DeepSpeed's parameter names and defaults, runs on any backend through the comm hooks, and keeps
all of its state, error-feedback buffers included, in ``state_dict()`` so a checkpoint resumes
exactly.

**The engine contract of the compressing optimizers.** They average gradients over the
data-parallel ``group`` themselves once their warm-up ends. Each exposes
``backward_allreduce: bool``: true while the engine must hand it gradients already averaged
over the group (warm-up), false once it must hand it this rank's own (the optimizer then
communicates its compressed momentum instead). The engine reads it before every backward;
``step()`` and ``load_state_dict()`` are the only calls that change it. Their
``rank_local_state`` names the state that belongs to the rank rather than to parameter elements
(the error-feedback buffers): checkpoints store it in each rank's file.
"""

from ds_core.optim.lamb import Lamb
from ds_core.optim.onebit_adam import OneBitAdam
from ds_core.optim.onebit_lamb import OneBitLamb
from ds_core.optim.zero_one_adam import ZeroOneAdam

__all__ = ["Lamb", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
