"""0/1 Adam (Lu et al., https://arxiv.org/abs/2202.06009): Adam whose variance is refreshed on an
exponentially thinning schedule and then frozen, after which ranks take local steps and only
exchange their accumulated update, compressed to 1 bit per element.

The update formulas, parameters, defaults and schedule are DeepSpeed's
(``deepspeed/runtime/fp16/onebit/zoadam.py``, ``ZeroOneAdam``); the communication is ds_core's
:func:`~ds_core.comm.compressed.compressed_all_reduce` (DeepSpeed's ``NcclBackend``
numerics) over the comm hooks, so every backend runs it. Instead of DeepSpeed's back-reference
to the engine, the optimizer says through :attr:`ZeroOneAdam.backward_allreduce` whether the
engine must average the gradients of the next step over the data-parallel group
(:mod:`ds_core.optim` gives the contract).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_core.comm import get_world_size
from ds_core.comm.compressed import compressed_all_reduce, padded_numel
from ds_core.optim._checks import check_at_least, check_common

__all__ = ["ZeroOneAdam"]

# Per-parameter schedule counters; all ranks hold the same values.
_COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter")


class ZeroOneAdam(torch.optim.Optimizer):
    """DeepSpeed's 0/1 Adam.

    **Schedule.** Steps count from 1 per parameter (``state["step"]``); the schedule follows
    the first parameter (in group order) that has state, as DeepSpeed's freeze test does.

    * Step 1 only creates the state: it counts the step and discards the gradient;
      parameters and moments are unchanged (DeepSpeed's ``initialize`` pass).
    * Variance phase, steps ``2 .. max(var_freeze_step + 1, 2)``: on a step with
      ``step % var_interval == 0`` the gradient arrives averaged over the group and both
      moments update, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g²``; on the other steps
      it arrives local, its compressed mean ``ĝ`` updates ``m`` only (with one rank there is
      nothing to compress and DeepSpeed leaves ``m`` unchanged: reproduced). ``var_interval``
      starts at 1 and doubles after every ``var_update_scaler`` variance updates.
    * Frozen phase, every later step: ``v`` stays fixed; ``m`` updates from the local gradient
      and ranks step on their own. On steps with ``step % local_step_interval == 0`` (the
      sync steps) each rank undoes its accumulated update ``u``, exchanges ``u × (√v + ε)``
      compressed, sets ``m = -mean / Σlr`` and applies ``mean / (√v + ε)``.
      ``local_step_interval`` starts at 1 and doubles, up to ``local_step_clipper``, after
      every ``local_step_scaler`` frozen steps. The error-feedback buffers are zeroed when the
      phase starts (they held gradient errors; they now hold momentum errors).

    Every step applies ``p -= lr (m / (√v + ε) + weight_decay p)``; in the frozen phase the
    same amount is added to ``u``.

    **backward_allreduce.** True at construction (the engine's default) and after step 1; in
    the variance phase, after step ``s``, true exactly when step ``s + 1`` updates the
    variance, i.e. ``(s + 1) % var_interval == 0``; false from the end of the variance phase
    on. ``load_state_dict`` recomputes it from the loaded step, so a resumed run asks for the
    same gradients as an uninterrupted one.

    **DeepSpeed quirks reproduced:** the first step discards its gradient; ``bias_correction``,
    ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and ignored (DeepSpeed stores them
    and never uses them: there is no bias correction and ε is always outside the root);
    one rank skips the momentum update of non-variance steps; a sync step divides by the sum
    of the learning rates since the last sync (``lr = 0`` throughout gives NaN, as there).

    **Differences from DeepSpeed:** all state, error-feedback buffers and counters included,
    is in ``state_dict()`` and ``load_state_dict()`` restores it as is (DeepSpeed drops the
    error buffers and the accumulated update, resets the counters and repeats the
    initialisation step); ``p.grad`` is not modified (DeepSpeed's compression may overwrite
    it); the no-op compressed all-reduce of zeros in DeepSpeed's first step is not run;
    ``load_state_dict`` does not modify the dictionary it is given; during the variance phase
    DeepSpeed sets the engine flag from the last parameter stepped, here from the reference
    parameter (the same whenever all parameters step together, as under the engine).

    **exp_avg_mask.** A parameter group may carry ``exp_avg_mask`` (a tensor of the parameters'
    shape, as in DeepSpeed): the compressed mean is multiplied by it on every compressed step
    (with more than one rank), so elements whose momentum is always exactly zero (which 1 bit
    cannot represent) stay zero. It belongs to the training script: ``load_state_dict`` keeps
    the groups' current masks and ignores saved ones, as DeepSpeed does.

    :param params: parameters or parameter groups; fp32 is DeepSpeed's case, other floating
        dtypes are compressed through fp32.
    :param lr: learning rate.
    :param bias_correction: accepted for DeepSpeed configs; unused (as in DeepSpeed).
    :param betas: ``(b1, b2)`` decay rates of the first and second moments, each in [0, 1).
    :param eps: added to ``√v`` in the denominator; >= 0.
    :param eps_inside_sqrt: accepted for DeepSpeed configs; unused (as in DeepSpeed).
    :param weight_decay: L2 coefficient added to the update (``weight_decay × p``); >= 0.
    :param max_grad_norm: accepted for DeepSpeed configs; unused (as in DeepSpeed).
    :param var_freeze_step: the variance phase ends after step ``var_freeze_step + 1``
        (steps); >= 0.
    :param var_update_scaler: variance updates per doubling of ``var_interval``; >= 1.
    :param local_step_scaler: frozen steps per doubling of ``local_step_interval``; >= 1.
    :param local_step_clipper: the largest ``local_step_interval`` (steps); >= 1.
    :param amsgrad: must be false: 0/1 Adam has no AMSGrad variant.
    :param group: the data-parallel process group to average over (``None``: all ranks).
    :raises ValueError: ``amsgrad`` is true, or a value is out of range (naming it).
    """

    backward_allreduce: bool
    #: state that belongs to this rank, not to parameter elements (checkpoints keep it per
    #: rank and restore it at the same world size).
    rank_local_state = ("worker_error", "server_error")
    """True: the engine must hand :meth:`step` gradients averaged over ``group``; false: this
    rank's own gradients (the optimizer communicates itself)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        group: Any = None,
    ) -> None:
        check_common("ZeroOneAdam", lr, betas, eps, weight_decay, amsgrad)
        check_at_least(
            "ZeroOneAdam", 0, max_grad_norm=max_grad_norm, var_freeze_step=var_freeze_step
        )
        # A scaler of 0 would never double its interval, a clipper of 0 would make the sync
        # test a modulo by zero: both are configuration errors.
        check_at_least(
            "ZeroOneAdam",
            1,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults)
        self.eps_inside_sqrt = eps_inside_sqrt
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.comm_group = group
        self.backward_allreduce = True

    # ------------------------------------------------------------------ schedule

    def _reference_state(self) -> dict[str, Any] | None:
        """The state the schedule follows: the first parameter's (in group order) that has one."""
        for g in self.param_groups:
            for p in g["params"]:
                state: dict[str, Any] | None = self.state.get(p)
                if state:
                    return state
        return None

    def _frozen_after(self, step: int) -> bool:
        """Whether the variance is frozen once the reference parameter has taken ``step`` steps.

        DeepSpeed tests ``step > var_freeze_step`` at the end of every step but the first
        (which returns early), hence the ``step >= 2``.
        """
        return step > self.var_freeze_step and step >= 2

    def _scheduled_backward_allreduce(self) -> bool:
        ref = self._reference_state()
        if ref is None:
            return True
        step = int(ref["step"])
        if self._frozen_after(step):
            return False
        return (step + 1) % int(ref["var_interval"]) == 0

    # ------------------------------------------------------------------ step

    def _init_state(self, p: torch.Tensor, world: int) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        padded = padded_numel(p.numel(), world)
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # u: the update applied since the last sync step (frozen phase only).
        state["momentum_accumulator"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=p.device)
        state["server_error"] = torch.zeros(padded // world, dtype=torch.float32, device=p.device)
        state["var_interval"] = 1
        state["var_counter"] = 0
        state["local_step_interval"] = 1
        state["local_step_counter"] = 0
        # Sum of the learning rates since the last sync step (a Python float: no host sync).
        state["lrs"] = 0.0
        return state

    def _compressed_mean(
        self, x: torch.Tensor, state: dict[str, Any], param_group: dict[str, Any]
    ) -> torch.Tensor:
        """The compressed mean of ``x`` over the group, masked by the group's ``exp_avg_mask``."""
        out = compressed_all_reduce(
            x.float(), state["worker_error"], state["server_error"], self.comm_group
        ).to(x.dtype)
        mask = param_group.get("exp_avg_mask")
        if mask is not None:
            out.mul_(mask.to(out.device))
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One 0/1 Adam step on every parameter with a gradient (the class docstring gives the
        schedule). Collective over the process group on compressed steps: every rank must call it.

        :param closure: re-evaluates the model and returns the loss; run with grad enabled.
        :returns: the closure's loss, or ``None``.
        :raises ValueError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = get_world_size(self.comm_group)
        ref = self._reference_state()
        # DeepSpeed's `initialize` flag: the first step() only creates the state.
        initialized = ref is not None
        frozen = ref is not None and self._frozen_after(int(ref["step"]))
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError("ZeroOneAdam: sparse gradients are not supported")
                state = self.state[p] if self.state.get(p) else self._init_state(p, world)
                state["step"] += 1
                if not initialized:
                    continue
                step = int(state["step"])
                exp_avg: torch.Tensor = state["exp_avg"]
                exp_avg_sq: torch.Tensor = state["exp_avg_sq"]
                acc: torch.Tensor = state["momentum_accumulator"]

                if frozen:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    state["lrs"] += lr
                elif step % state["var_interval"] == 0:
                    # The engine averaged this gradient (backward_allreduce was true).
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                elif world > 1:
                    exp_avg.mul_(beta1).add_(
                        self._compressed_mean(grad, state, group), alpha=1 - beta1
                    )

                update = exp_avg / (exp_avg_sq.sqrt() + eps)
                if wd > 0.0:
                    update += wd * p
                p.add_(-lr * update)
                if frozen:
                    acc.add_(-lr * update)
                    if step % state["local_step_interval"] == 0:
                        # Sync: back to the parameters of the last sync, exchange the update in
                        # momentum units (u × (√v + ε)), and apply the group's mean instead.
                        p.sub_(acc)
                        acc.mul_(exp_avg_sq.sqrt() + eps)
                        if world > 1:
                            acc.copy_(self._compressed_mean(acc, state, group))
                        exp_avg.zero_().add_(acc / state["lrs"], alpha=-1)
                        p.add_(acc / (exp_avg_sq.sqrt() + eps))
                        acc.zero_()
                        state["lrs"] = 0.0
                    state["local_step_counter"] += 1
                    if state["local_step_counter"] == self.local_step_scaler:
                        state["local_step_counter"] = 0
                        state["local_step_interval"] = min(
                            self.local_step_clipper, state["local_step_interval"] * 2
                        )
                elif step % state["var_interval"] == 0:
                    state["var_counter"] += 1
                    if state["var_counter"] == self.var_update_scaler:
                        state["var_counter"] = 0
                        state["var_interval"] *= 2

        if initialized and not frozen:
            ref = self._reference_state()
            if ref is not None and self._frozen_after(int(ref["step"])):
                # The frozen phase starts: its error feedback is for the accumulated update,
                # not for gradients, so the gradient-phase errors are dropped (as DeepSpeed).
                for g in self.param_groups:
                    for p in g["params"]:
                        state = self.state.get(p)
                        if state:
                            state["worker_error"].zero_()
                            state["server_error"].zero_()
        self.backward_allreduce = self._scheduled_backward_allreduce()
        return loss

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, error-feedback buffers and counters included, so the
        next step continues exactly; :attr:`backward_allreduce` is set from the loaded step.

        :raises ValueError: as ``torch.optim.Optimizer.load_state_dict``, or an error buffer's size
            does not fit this group's world size (the checkpoint was saved with another one).
        """
        # The masks are the training script's (they may change between stages, e.g. sequence
        # lengths): keep the current ones, on copies so the caller's dictionary is untouched.
        groups = []
        for i, saved in enumerate(state_dict["param_groups"]):
            saved = {k: v for k, v in saved.items() if k != "exp_avg_mask"}
            if i < len(self.param_groups) and "exp_avg_mask" in self.param_groups[i]:
                saved["exp_avg_mask"] = self.param_groups[i]["exp_avg_mask"]
            groups.append(saved)
        super().load_state_dict({**state_dict, "param_groups": groups})
        world = get_world_size(self.comm_group)
        for g in self.param_groups:
            for p in g["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                padded = padded_numel(p.numel(), world)
                worker, server = state["worker_error"], state["server_error"]
                if worker.numel() != padded or server.numel() != padded // world:
                    raise ValueError(
                        f"ZeroOneAdam.load_state_dict: error buffers of {worker.numel()} and "
                        f"{server.numel()} elements do not fit a {p.numel()}-element parameter on "
                        f"{world} ranks ({padded} and {padded // world}): saved with another world size"
                    )
                # torch casts floating state to the parameter's dtype; the compression needs fp32.
                state["worker_error"] = worker.to(torch.float32)
                state["server_error"] = server.to(torch.float32)
                for key in _COUNTERS:
                    state[key] = int(state[key])
                state["step"] = int(state["step"])
        self.backward_allreduce = self._scheduled_backward_allreduce()
