"""Checks at the engine's edges: what ``initialize()`` accepts as a model, what ``backward``
accepts as a loss, and which engine a model belongs to.

A model belongs to at most one live engine: a second engine over the same parameters would
re-partition them while the first engine's gradient hooks stay registered, and train nothing
(the first engine's buffers keep the parameters). ``initialize()`` refuses it, naming the first
engine; ``engine.destroy()`` releases the model, but also empties its parameters (their storage
was the engine's), so a destroyed engine's model is refused too: build a fresh model.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import torch
from torch import nn

from ds_core.errors import ConfigError

__all__ = ["EngineDestroyedError", "check_loss", "check_model", "claim", "describe_caller"]

#: set on each parameter an engine wraps: the engine's label (see :func:`claim`).
OWNER_ATTR = "ds_core_owner"
#: set on each parameter by ``destroy()``: the label of the engine that released it.
RELEASED_ATTR = "ds_core_released_by"

_counter = itertools.count(1)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the fault boundaries wrapping the engine's methods (ds_core.faults): not the caller either
_WRAPPER = os.path.join(os.path.dirname(_PACKAGE), "faults.py")


class EngineDestroyedError(RuntimeError):
    """A call on an engine after ``engine.destroy()``."""


def describe_caller() -> str:
    """``file:line`` of the first frame outside ds_core (where the user built the engine)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE + os.sep) and path != _WRAPPER:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def new_label(stage: int) -> str:
    """A label naming an engine in errors: ``engine #N (ZeRO stage S, built at file:line)``."""
    return f"engine #{next(_counter)} (ZeRO stage {stage}, built at {describe_caller()})"


def check_model(model: Any, training: bool) -> nn.Module:
    """``model``, or an error for what cannot be a model for a new engine.

    :param training: the engine will have an optimizer (a forward-only engine may hold a
        model without trainable parameters).
    :raises ConfigError: ``model`` is None or not an ``nn.Module``; one of its parameters
        belongs to a live engine (naming it) or was released by a destroyed one; training with
        no parameters, or with every parameter frozen.
    """
    if model is None:
        raise ConfigError("initialize(model=None): model must be a torch.nn.Module")
    if not isinstance(model, nn.Module):
        hint = (
            " (wrap a function in an nn.Module whose forward calls it)" if callable(model) else ""
        )
        raise ConfigError(
            "initialize(model=...): model must be a torch.nn.Module, got "
            f"{type(model).__name__}{hint}"
        )
    params = list(model.parameters())
    for p in params:
        owner = _mark(p, OWNER_ATTR)
        if owner is not None:
            raise ConfigError(
                f"initialize(model=...): this model already belongs to {owner}, which is "
                "still live; a second engine over the same parameters would train nothing. "
                "Keep using the first engine, or build a fresh model"
            )
        released = _mark(p, RELEASED_ATTR)
        if released is not None:
            raise ConfigError(
                "initialize(model=...): this model's parameters were emptied when "
                f"{released} was destroyed (their storage was the engine's); build a fresh model"
            )
    if not training:
        return model
    if not params:
        raise ConfigError(
            "initialize(model=...): the model has no parameters, so there is nothing to "
            "train (for a forward-only engine pass no optimizer and no 'optimizer' section)"
        )
    if not any(p.requires_grad for p in params):
        raise ConfigError(
            f"initialize(model=...): all {len(params)} parameters of the model are frozen "
            "(requires_grad=False), so there is nothing to train; unfreeze some, or pass no "
            "optimizer and no 'optimizer' section for a forward-only engine"
        )
    return model


def _mark(p: torch.Tensor, attr: str) -> str | None:
    """The label in ``p``'s mark ``attr``; a mark copied with the tensor (``deepcopy``) is
    not this parameter's and reads as none."""
    mark = getattr(p, attr, None)
    if isinstance(mark, tuple) and len(mark) == 2 and mark[0] == id(p):
        return str(mark[1])
    return None


def claim(model: nn.Module, label: str) -> None:
    """Mark every parameter of ``model`` as owned by the engine ``label``."""
    for p in model.parameters():
        setattr(p, OWNER_ATTR, (id(p), label))


def release(model: nn.Module, label: str) -> None:
    """``destroy()``: the parameters no longer belong to ``label``, which emptied them."""
    for p in model.parameters():
        if _mark(p, OWNER_ATTR) == label:
            delattr(p, OWNER_ATTR)
            setattr(p, RELEASED_ATTR, (id(p), label))


def require_alive(engine: Any, what: str) -> None:
    """:raises EngineDestroyedError: ``engine.destroy()`` was called."""
    if getattr(engine, "_destroyed", False):
        raise EngineDestroyedError(
            f"{what}(): {engine.label} was destroyed (engine.destroy() released its buffers "
            "and emptied the model's parameters); build a new model and engine"
        )


def check_loss(loss: Any, where: str = "backward(loss)") -> None:
    """``backward(loss)`` (or ``where``: ``scale(loss)``) takes a one-element tensor that
    autograd can reach the model from.

    :raises TypeError: ``loss`` is not a tensor.
    :raises ValueError: ``loss`` has more than one element, or does not require grad.
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{where}: loss must be a torch.Tensor, got {type(loss).__name__} "
            "(pass the tensor the forward returned, not loss.item())"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"{where}: loss must be a scalar, got shape {tuple(loss.shape)}; reduce it "
            "first (loss.mean() or loss.sum())"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{where}: loss does not require grad, so it is not connected to the "
            "model's trainable parameters (computed under torch.no_grad(), detached, or from "
            "frozen parameters only)"
        )
