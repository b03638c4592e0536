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
``step()`` and ``load_state_dict()`` are the only calls that change it.
"""
