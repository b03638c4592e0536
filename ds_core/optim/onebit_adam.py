"""1-bit Adam: Adam whose data-parallel communication, after a warm-up, is the momentum
compressed to one bit per element (:func:`~ds_core.comm.compressed.compressed_all_reduce`).

The update is DeepSpeed's (``deepspeed/runtime/fp16/onebit/adam.py``, ``OnebitAdam``), step for
step, so a DeepSpeed config trains the same:

- **Step 1 applies nothing.** DeepSpeed's first ``step()`` only sets up its communication
  buffers: the step counter becomes 1 and the parameters and moments stay as they were.
- **Warm-up** (until the step counter reaches ``freeze_step``): the engine averages gradients
  over the group (``backward_allreduce`` is true) and ``m = b1 m + (1 - b1) g``,
  ``v = b2 v + (1 - b2) g²``.
- **Compression** (the steps after): ``v`` is frozen; the engine hands over this rank's own
  gradient, ``m = b1 m + (1 - b1) g`` locally, then ``m`` is replaced by the compressed mean of
  every rank's ``m`` (error feedback kept per parameter in ``worker_error`` / ``server_error``).
  A group with ``"non_freeze": True`` keeps exact all-reduced Adam instead; a group's
  ``"exp_avg_mask"`` (a 0/1 tensor of the parameter's shape) is multiplied into ``m`` after
  the reduction, for rows whose momentum must stay exactly zero.
- Both phases: ``p -= lr (m / (sqrt(v) + eps) + weight_decay p)``, with no bias correction.
  DeepSpeed accepts ``bias_correction``, ``eps_inside_sqrt`` and ``max_grad_norm`` and uses
  none of them in this update; so does this class (they are kept in the groups).

Unlike DeepSpeed, whose ``load_state_dict`` resets the error buffers (it saves rank 0's only),
every buffer is per-parameter state here, and the engine saves each rank's: a resumed run
continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_core import comm
from ds_core.comm.compressed import compressed_all_reduce, padded_numel
from ds_core.optim._checks import check_at_least, check_common

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.Optimizer):
    """DeepSpeed's 1-bit Adam (the module docstring gives the update).

    :param params: parameters or parameter groups (fp32, on the accelerator's device).
    :param lr: learning rate.
    :param freeze_step: the step counter at which warm-up ends; later steps compress.
    :param betas: ``(b1, b2)``, each in [0, 1).
    :param eps: added to ``sqrt(v)``; > 0.
    :param weight_decay: decoupled weight decay, scaled by ``lr``; >= 0.
    :param bias_correction: accepted and unused, as in DeepSpeed.
    :param eps_inside_sqrt: accepted and unused, as in DeepSpeed.
    :param max_grad_norm: accepted and unused, as in DeepSpeed (the engine clips).
    :param amsgrad: must be false (DeepSpeed refuses it too).
    :param group: the data-parallel group gradients and momenta are averaged over
        (``None``: every rank).
    :raises ValueError: a hyper-parameter out of range, or ``amsgrad``, naming it.
    """

    #: the engine's cue: average gradients over the group before :meth:`step` (warm-up).
    backward_allreduce: bool
    #: state that belongs to this rank, not to parameter elements (checkpoints keep it per
    #: rank and restore it at the same world size).
    rank_local_state = ("worker_error", "server_error")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        group: Any = None,
    ) -> None:
        check_common("OneBitAdam", lr, betas, eps, weight_decay, amsgrad)
        check_at_least("OneBitAdam", 0, freeze_step=freeze_step)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.comm_group = group
        self.world = comm.get_world_size(group)
        self.backward_allreduce = True

    # -- phases, derived from the step counter so a loaded state knows its own -------------

    def _step_count(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    return int(state["step"])
        return 0

    def _compressing(self) -> bool:
        # DeepSpeed decides at the end of each step after the set-up step: compression
        # starts after the step whose counter reaches freeze_step, and never before step 3.
        return self._step_count() >= max(self.freeze_step, 2)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update from each parameter's ``.grad`` (see the module docstring); parameters
        without a gradient are skipped. Issues one compressed all-reduce per parameter during
        compression, on the current stream; reads nothing on the host.

        :returns: ``closure()``'s loss, if a closure was given.
        :raises RuntimeError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = self._step_count() == 0
        compressing = self._compressing()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("OneBitAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if first:
                    continue  # DeepSpeed's set-up step (module docstring)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if not compressing:
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                elif group.get("non_freeze", False):
                    grad = grad.clone()
                    comm.all_reduce(grad, "sum", self.comm_group)
                    grad.mul_(1.0 / self.world)
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                else:
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    if self.world > 1:
                        self._errors(state, p)
                        m.copy_(
                            compressed_all_reduce(
                                m, state["worker_error"], state["server_error"], self.comm_group
                            )
                        )
                    mask = group.get("exp_avg_mask")
                    if mask is not None:
                        m.mul_(mask.to(m.device))
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        self.backward_allreduce = not self._compressing()
        return loss

    def _errors(self, state: dict[str, Any], p: torch.Tensor) -> None:
        if "worker_error" not in state:
            padded = padded_numel(p.numel(), self.world)
            state["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=p.device)
            state["server_error"] = torch.zeros(
                padded // self.world, dtype=torch.float32, device=p.device
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, error buffers included; the phase follows the loaded
        step counter. A group's ``exp_avg_mask`` is the one this optimizer was built with
        (the mask belongs to the training script, as in DeepSpeed).

        :raises ValueError: as ``torch.optim.Optimizer.load_state_dict`` (group mismatch).
        """
        groups = state_dict["param_groups"]
        for mine, theirs in zip(self.param_groups, groups, strict=False):
            theirs.pop("exp_avg_mask", None)
            if "exp_avg_mask" in mine:
                theirs["exp_avg_mask"] = mine["exp_avg_mask"]
        super().load_state_dict(state_dict)
        self.backward_allreduce = not self._compressing()
