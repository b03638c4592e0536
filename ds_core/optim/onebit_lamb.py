"""1-bit LAMB: LAMB whose data-parallel communication, after a warm-up, is the momentum of every
parameter fused into one buffer and compressed to one bit per element
(:func:`~ds_core.comm.compressed.compressed_all_reduce`).

The update is DeepSpeed's (``deepspeed/runtime/fp16/onebit/lamb.py``, ``OnebitLamb``), step for
step, so a DeepSpeed config trains the same. Per parameter ``p`` (``m``, ``v`` its moments,
``b1``, ``b2`` the betas, ``clip(x, lo, hi)`` DeepSpeed's "above hi: hi, then below lo: lo"):

- **Step 1 applies nothing.** DeepSpeed's first ``step()`` only creates the state (moments at
  zero) and sets up its communication buffers: the gradient is dropped, the step counter
  becomes 1 and the parameters stay as they were (DeepSpeed's set-up all-reduce of the zero
  momentum changes nothing, so it is not issued here).
- **Warm-up** (the steps after, until the counter reaches ``freeze_step``; never before the
  counter is 2): the engine averages the gradients ``g`` over the group
  (``backward_allreduce`` is true) and this is LAMB without bias correction:
  ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g²``,
  ``u = m / (sqrt(v) + eps) + weight_decay p``,
  ``c = clip(||p|| / ||u||, min_coeff, max_coeff)`` (``1`` when either norm is 0),
  ``p -= lr c u``. Each ``c != 1`` enters the running average
  ``lamb_coeff_freeze = coeff_beta lamb_coeff_freeze + (1 - coeff_beta) c``. At the step whose
  counter equals ``freeze_step``, ``v`` is copied to ``exp_avg_sq_fresh``.
- **Compression** (every step once the counter has reached ``max(freeze_step, 2)``): ``v`` is
  frozen; the engine hands over this rank's own gradient (``backward_allreduce`` is false).
  At the first such step each parameter gets ``scaling_coeff = mean_q(s_q) / s_p`` with
  ``s = ||m|| / sqrt(numel)``, so that all momenta have the same magnitude in the fused buffer.
  Then ``m = b1 m + (1 - b1) g`` locally; every ``m * scaling_coeff``, concatenated in
  parameter order, is replaced by its compressed mean over the group (error feedback in
  ``worker_error`` / ``server_error``), divided by ``scaling_coeff`` again and multiplied by a
  group's ``"exp_avg_mask"`` if it has one. The gradient is reconstructed from the momentum,
  ``r = (m - b1 m_before) / (1 - b1)``, to keep a fresh variance
  ``exp_avg_sq_fresh = b2 exp_avg_sq_fresh + (1 - b2) r²``. With
  ``d = sqrt(v) + eps``, ``u0 = m / d``, ``u = u0 + weight_decay p``, the scaling factor is
  ``f = max(d / (sqrt(exp_avg_sq_fresh) + eps))``; with weight decay
  ``f = f a + (1 - a)``, ``a = min(1, ||u0|| / ||u||)``; then ``f = clip(f, factor_min,
  factor_max)`` and at most ``factor_threshold`` away (relative) from the previous step's
  ``last_factor``. ``p -= lr lamb_coeff_freeze f u``.

As in DeepSpeed, ``bias_correction``, ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted,
kept in the groups and used by no formula; ``freeze_step``, ``coeff_beta`` and the ``factor_*``
settings are the optimizer's, not the groups'. Parameters with no elements are left out, as
DeepSpeed's ``filter_empty_parameters`` does.

Deliberate differences from DeepSpeed:

- Everything lives in ``self.state``, so ``state_dict()`` / ``load_state_dict()`` resume bit
  for bit: per parameter ``step``, the moments, ``exp_avg_sq_fresh``, ``lamb_coeff_freeze``,
  ``last_factor``, ``scaling_coeff`` and ``lamb_coeff`` (the coefficient of the last step);
  in the first parameter's state also ``fused_numels`` (the fused buffer's layout) and the error
  buffers. DeepSpeed resets the error buffers on load, forgets the lamb coefficients and
  scaling coefficients when the checkpoint is from the warm-up, and spends its first step after
  a load setting up again (dropping that gradient); none of that happens here. The phase
  follows the step counter, so a run loaded after step 1 with ``freeze_step <= 1`` continues
  in warm-up as the straight run does (DeepSpeed would start compressing).
- The coefficients stay device tensors: ``step()`` never reads anything on the host
  (DeepSpeed calls ``.item()`` per parameter). :meth:`get_lamb_coeffs` reads them.
- Every parameter must have a gradient at every step (the momentum is one fused buffer):
  ``step()`` raises :class:`RuntimeError` otherwise, where DeepSpeed fails at its first step or
  mixes a stale momentum into the buffer.
- A parameter whose momentum is exactly zero at the end of warm-up gets ``scaling_coeff = 1``
  (DeepSpeed divides by its zero scale and raises ``ZeroDivisionError``).
- ``amsgrad=True`` raises :class:`ValueError` (DeepSpeed: ``RuntimeError``), and the other
  hyper-parameters are range-checked (DeepSpeed checks none).
- The buffers communicated are fp32 whatever the parameters' dtype (the compressed all-reduce
  works in fp32); the scalar coefficients are fp32 device tensors where DeepSpeed has Python
  floats (float64), a relative difference of about 1e-7.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_core import comm
from ds_core.comm.compressed import compressed_all_reduce, padded_numel
from ds_core.optim._checks import check_at_least, check_common

__all__ = ["OneBitLamb"]


def _drop_empty(params: Iterable[Any]) -> list[Any]:
    """``params`` (tensors or group dicts) without the parameters that have no elements, and
    without groups left empty: DeepSpeed's ``filter_empty_parameters``, since a zero-element
    momentum would make its scale ``0 / 0``."""
    items = list(params)
    if not items or not isinstance(items[0], dict):
        return [p for p in items if p.numel() > 0]
    groups = []
    for group in items:
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        kept = [p for p in members if p.numel() > 0]
        if kept:
            groups.append({**group, "params": kept})
    return groups


class OneBitLamb(torch.optim.Optimizer):
    """DeepSpeed's 1-bit LAMB (the module docstring gives the phases and formulas).

    :param params: parameters or parameter groups, all on one device (the accelerator's when
        the group has more than one rank); floating point.
    :param lr: learning rate (units of the parameters per unit of the normalised update); >= 0.
    :param freeze_step: the step counter at which warm-up ends; later steps compress; >= 0.
    :param bias_correction: accepted and unused, as in DeepSpeed.
    :param betas: ``(b1, b2)``, the moments' decay per step, each in [0, 1).
    :param eps: added to ``sqrt(v)``; >= 0.
    :param eps_inside_sqrt: accepted and unused, as in DeepSpeed.
    :param weight_decay: coefficient of ``p`` added to the update before the trust ratio; >= 0.
    :param max_grad_norm: accepted and unused, as in DeepSpeed (the engine clips).
    :param max_coeff: upper bound of the warm-up's trust ratio; >= ``min_coeff``.
    :param min_coeff: lower bound of the warm-up's trust ratio; >= 0.
    :param amsgrad: must be false (DeepSpeed refuses it too).
    :param coeff_beta: decay per step of the running average of the trust ratio that the
        compression stage freezes, in [0, 1); ``1 / (1 - coeff_beta)`` should not exceed
        ``freeze_step``.
    :param factor_max: upper bound of the compression stage's scaling factor; >= ``factor_min``.
    :param factor_min: lower bound of the scaling factor; >= 0.
    :param factor_threshold: largest relative change of the scaling factor from one step to
        the next, in [0, 1].
    :param group: the data-parallel group gradients and momenta are averaged over
        (``None``: every rank).
    :raises ValueError: ``amsgrad``, or a hyper-parameter out of range, naming it.
    """

    #: the engine's cue: hand :meth:`step` gradients averaged over the group (true, warm-up
    #: and the set-up step) or this rank's own (false, compression).
    backward_allreduce: bool
    #: state that belongs to this rank, not to parameter elements (checkpoints keep it per
    #: rank and restore it at the same world size; the layout is rebuilt on load).
    rank_local_state = ("worker_error", "server_error", "fused_numels")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        group: Any = None,
    ) -> None:
        check_common("OneBitLamb", lr, betas, eps, weight_decay, amsgrad)
        check_at_least(
            "OneBitLamb", 0, freeze_step=freeze_step, min_coeff=min_coeff, factor_min=factor_min
        )
        if min_coeff > max_coeff:
            raise ValueError(f"min_coeff ({min_coeff}) must not exceed max_coeff ({max_coeff})")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta}")
        if factor_min > factor_max:
            raise ValueError(f"factor_min ({factor_min}) must not exceed factor_max ({factor_max})")
        if not 0.0 <= factor_threshold <= 1.0:
            raise ValueError(f"factor_threshold must be in [0, 1], got {factor_threshold}")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_grad_norm": max_grad_norm,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(_drop_empty(params), defaults)
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max = float(factor_max)
        self.factor_min = float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.comm_group = group
        self.world = comm.get_world_size(group)
        # DeepSpeed's engine starts with its gradient all-reduce on.
        self.backward_allreduce = True

    # -- bookkeeping ---------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        """Every parameter, in the fused buffer's order (groups, then members)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _step_count(self) -> int:
        """The step counter (0 before the first step); the same for every parameter."""
        state = self.state.get(self.param_groups[0]["params"][0])
        return int(state["step"]) if state else 0

    def _compressing(self) -> bool:
        """Whether the next step compresses. DeepSpeed switches at the end of a warm-up step
        whose counter is >= freeze_step; its set-up step (counter 1) never checks, hence 2."""
        return self._step_count() >= max(self.freeze_step, 2)

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update from each parameter's ``.grad`` (the module docstring gives the phase and
        formulas), then :attr:`backward_allreduce` for the next step.

        ``.grad`` must be averaged over the group when :attr:`backward_allreduce` is true, this
        rank's own when it is false. During compression every rank of the group must call it
        (one compressed all-reduce of all momenta, on the current stream). The optimizer reads
        nothing on the host: DeepSpeed's per-step scalars (trust ratio, scaling factor) stay
        device tensors, so no host read per step is needed at all.

        :returns: ``closure()``'s loss, if a closure was given.
        :raises RuntimeError: a parameter without a gradient, or with a sparse one.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        for i, p in enumerate(params):
            if p.grad is None:
                raise RuntimeError(
                    f"OneBitLamb: parameter {i} has no gradient; every parameter needs one at "
                    "every step (the momenta are fused into one buffer; give unused ones zeros)"
                )
            if p.grad.is_sparse:
                raise RuntimeError("OneBitLamb does not support sparse gradients")
        first = self._step_count() == 0
        compressing = self._compressing()
        for p in params:
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            state["step"] += 1
        if first:
            # DeepSpeed's set-up step: state created, gradient dropped (module docstring).
            self.state[params[0]]["fused_numels"] = [p.numel() for p in params]
            return loss
        if compressing:
            self._compression_step()
        else:
            self._warmup_step()
        self.backward_allreduce = not self._compressing()
        return loss

    @staticmethod
    def _init_state(p: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq_fresh"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # fp32 device scalars (DeepSpeed's Python floats 0.0 and 1.0): no host read to update.
        state["lamb_coeff_freeze"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["last_factor"] = torch.ones((), dtype=torch.float32, device=p.device)

    def _warmup_step(self) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            max_coeff, min_coeff = group["max_coeff"], group["min_coeff"]
            for p in group["params"]:
                state = self.state[p]
                grad = p.grad
                assert grad is not None  # checked in step()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                if state["step"] == self.freeze_step:
                    state["exp_avg_sq_fresh"].copy_(v)
                weight_norm = torch.linalg.vector_norm(p, dtype=torch.float32)
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update.add_(p, alpha=group["weight_decay"])
                update_norm = torch.linalg.vector_norm(update, dtype=torch.float32)
                # DeepSpeed's comparisons, one by one, so NaN takes the same branches.
                ratio = weight_norm / update_norm
                coeff = torch.where(ratio > max_coeff, max_coeff, ratio)
                coeff = torch.where(coeff < min_coeff, min_coeff, coeff)
                coeff = torch.where((weight_norm != 0) & (update_norm != 0), coeff, 1.0)
                # A coefficient of exactly 1 (the "no ratio" default) is not averaged in.
                frozen = state["lamb_coeff_freeze"]
                averaged = frozen * self.coeff_beta + coeff * (1 - self.coeff_beta)
                frozen.copy_(torch.where(coeff != 1.0, averaged, frozen))
                state["lamb_coeff"] = coeff
                p.add_(update * (coeff * -group["lr"]))

    def _compression_step(self) -> None:
        params = self._params()
        head = self.state[params[0]]
        if "scaling_coeff" not in head:
            self._set_scaling_coeffs(params)
        before = [self.state[p]["exp_avg"].clone() for p in params]
        for group in self.param_groups:
            b1 = group["betas"][0]
            for p in group["params"]:
                state = self.state[p]
                assert p.grad is not None  # checked in step()
                # The local gradient, scaled so every momentum weighs the same in the buffer.
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg"].mul_(state["scaling_coeff"])
        # DeepSpeed skips the communication on a group of one rank (the momentum is already
        # the mean); it still scales and unscales, and so does this.
        if self.world > 1:
            flat = torch.cat([self.state[p]["exp_avg"].reshape(-1).float() for p in params])
            if "worker_error" not in head:
                padded = padded_numel(flat.numel(), self.world)
                head["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=flat.device)
                head["server_error"] = torch.zeros(
                    padded // self.world, dtype=torch.float32, device=flat.device
                )
            mean = compressed_all_reduce(
                flat, head["worker_error"], head["server_error"], self.comm_group
            )
            offset = 0
            for p in params:
                m = self.state[p]["exp_avg"]
                m.copy_(mean[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
        for group, last_group in zip(self.param_groups, self._split(before), strict=True):
            self._compressed_update(group, last_group)

    def _split(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``tensors`` (one per parameter, in order) cut into the parameter groups."""
        out, start = [], 0
        for group in self.param_groups:
            out.append(tensors[start : start + len(group["params"])])
            start += len(group["params"])
        return out

    def _set_scaling_coeffs(self, params: list[torch.Tensor]) -> None:
        """``scaling_coeff = mean(s) / s_p``, ``s = ||m|| / sqrt(numel)``, from the momenta
        the warm-up left (the same on every rank, the gradients having been averaged)."""
        scales = [
            torch.linalg.vector_norm(self.state[p]["exp_avg"], dtype=torch.float32)
            / math.sqrt(p.numel())
            for p in params
        ]
        united = torch.stack(scales).mean()
        for p, scale in zip(params, scales, strict=True):
            # A zero momentum stays zero whatever its scale: 1 instead of DeepSpeed's 1 / 0.
            self.state[p]["scaling_coeff"] = torch.where(scale == 0, 1.0, united / scale)

    def _compressed_update(self, group: dict[str, Any], last_momenta: list[torch.Tensor]) -> None:
        b1, b2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        mask = group.get("exp_avg_mask")
        if mask is not None and mask.device != group["params"][0].device:
            # Moved once and kept in the group (as DeepSpeed does), not copied every step.
            mask = group["exp_avg_mask"] = mask.to(group["params"][0].device)
        for p, last in zip(group["params"], last_momenta, strict=True):
            state = self.state[p]
            m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
            m.div_(state["scaling_coeff"])
            if mask is not None:
                # Rows whose momentum must stay exactly zero: 1-bit signs cannot say zero.
                m.mul_(mask)
            # The gradient the averaged momentum implies keeps a live variance estimate.
            grad = (m - last * b1) / (1 - b1)
            fresh.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = v.sqrt() + eps
            prelim = m / denom
            update = prelim + weight_decay * p if weight_decay > 0.0 else prelim
            update_norm = torch.linalg.vector_norm(update, dtype=torch.float32)
            factor = (denom / (fresh.sqrt() + eps)).max().float()
            if weight_decay > 0.0:
                ratio = torch.linalg.vector_norm(prelim, dtype=torch.float32) / update_norm
                ratio = torch.where(ratio < 1.0, ratio, 1.0)  # Python's min(1.0, ratio)
                factor = factor * ratio + (1.0 - ratio)
            # DeepSpeed's comparisons in its order, so NaN takes the same branches.
            factor = torch.where(factor > self.factor_max, self.factor_max, factor)
            factor = torch.where(factor < self.factor_min, self.factor_min, factor)
            last_factor = state["last_factor"]
            high = last_factor * (1.0 + self.factor_threshold)
            factor = torch.where(factor > high, high, factor)
            low = last_factor * (1.0 - self.factor_threshold)
            factor = torch.where(factor < low, low, factor)
            last_factor.copy_(factor)
            coeff = state["lamb_coeff_freeze"] * factor
            state["lamb_coeff"] = coeff
            p.add_(update * (coeff * -group["lr"]))

    # -- introspection and checkpoints ---------------------------------------------------------

    def get_lamb_coeffs(self) -> list[float]:
        """The trust coefficients the last step applied, one per parameter in order (empty
        before the first update). A new list; reads the device once.
        """
        coeffs = [
            self.state[p]["lamb_coeff"] for p in self._params() if "lamb_coeff" in self.state[p]
        ]
        if not coeffs:
            return []
        values: list[float] = torch.stack([c.float() for c in coeffs]).tolist()
        return values

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: every tensor is copied exactly (dtype kept) onto its
        parameter's device, error buffers included, and :attr:`backward_allreduce` follows the
        loaded step counter. A group's ``exp_avg_mask`` is the one this optimizer was built with
        (the mask belongs to the training script, as in DeepSpeed). Error buffers saved for
        another group size are dropped, so compression restarts its error feedback from zero
        (with a warning), which is what DeepSpeed does on every load.

        :raises ValueError: groups that do not match (as ``torch.optim.Optimizer``), or a saved
            fused layout (parameter sizes) other than this optimizer's.
        """
        groups = []
        for i, saved in enumerate(state_dict["param_groups"]):
            saved = {k: v for k, v in saved.items() if k != "exp_avg_mask"}
            if i < len(self.param_groups) and "exp_avg_mask" in self.param_groups[i]:
                saved["exp_avg_mask"] = self.param_groups[i]["exp_avg_mask"]
            groups.append(saved)
        super().load_state_dict({**state_dict, "param_groups": groups})
        # torch casts floating state to the parameter's dtype and may share storage with
        # state_dict: take the saved tensors themselves, copied, so the resume is exact.
        params = self._params()
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for idx, p in zip(saved_ids, params, strict=True):
            saved_state = state_dict["state"].get(idx)
            if saved_state is None:
                continue
            self.state[p] = {
                k: v.detach().to(device=p.device, copy=True) if isinstance(v, torch.Tensor) else v
                for k, v in saved_state.items()
            }
        head = self.state.get(params[0]) if params else None
        if head:
            numels = [p.numel() for p in params]
            saved_numels = head.get("fused_numels", numels)
            if list(saved_numels) != numels:
                raise ValueError(
                    f"OneBitLamb.load_state_dict: the checkpoint's parameter sizes "
                    f"{list(saved_numels)} differ from this optimizer's {numels}"
                )
            head["fused_numels"] = numels
            if "worker_error" in head:
                padded = padded_numel(sum(numels), self.world)
                fits = head["worker_error"].numel() == padded and (
                    head["server_error"].numel() == padded // self.world
                )
                if not fits:
                    warnings.warn(
                        "OneBitLamb.load_state_dict: the error buffers were saved for another "
                        "number of ranks; compression restarts its error feedback from zero",
                        stacklevel=2,
                    )
                    del head["worker_error"], head["server_error"]
        self.backward_allreduce = not self._compressing()
