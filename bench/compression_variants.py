"""The diagnostic variants of 1-bit Adam that ``bench/compression.py`` runs beside it, to tell
apart the causes of its loss gap to uncompressed training (not DeepSpeed modes):

- ``onebit_adam_exact``: after the freeze, the exact mean of the ranks' momenta (an fp32
  all-reduce) in place of the compressed all-reduce; each rank still hands over and clips its
  own gradient, and the variance stays frozen. Against ``onebit_adam``: the compression error.
- ``onebit_adam_frozen``: after the freeze the engine keeps averaging the gradients (and
  clipping the average, as in warm-up); the momenta are then equal on every rank and their
  "mean" is a copy; only the variance is frozen. Against ``onebit_adam_exact``: clipping each
  rank's own gradient; against the uncompressed reference: the frozen variance.

Both patch ``ds_core.optim.onebit_adam``'s reference to the compressed all-reduce in the rank's
process for the one configuration (:func:`apply`), and undo it after (the returned function).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VARIANTS = ("onebit_adam_exact", "onebit_adam_frozen")


def exact_mean(
    buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """The exact mean of ``buffer`` over ``group``, in the compressed all-reduce's signature
    (the error buffers are left as they are: zero)."""
    from ds_core import comm

    out = buffer.detach().clone()
    comm.all_reduce(out, "sum", group)
    return out.div_(comm.get_world_size(group))


def copy(
    buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """``buffer`` itself, copied: the mean of momenta that are equal on every rank."""
    return buffer.detach().clone()


def apply(name: str) -> Callable[[], None]:
    """Patch the all-reduce of 1-bit Adam for configuration ``name`` (nothing for a name not in
    :data:`VARIANTS`); returns the function that undoes it."""
    import ds_core.optim.onebit_adam as onebit

    saved = onebit.compressed_all_reduce
    if name in VARIANTS:
        onebit.compressed_all_reduce = exact_mean if name == "onebit_adam_exact" else copy

    def undo() -> None:
        onebit.compressed_all_reduce = saved

    return undo


def adjust(name: str, optimizer: Any) -> None:
    """For ``onebit_adam_frozen``, keep the engine averaging gradients after the freeze
    (``optimizer.backward_allreduce`` reset to true after every step); else nothing."""
    if name != "onebit_adam_frozen":
        return
    step = optimizer.step

    def stepped(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        optimizer.backward_allreduce = True
        return out

    optimizer.step = stepped
