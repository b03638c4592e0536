"""A data loader that knows its position, so a checkpoint can resume mid-epoch.

Wrap the loader ``initialize`` returned (or any re-iterable loader whose order depends only on
its epoch) and hand it to the engine as ``engine.training_dataloader``: ``save_checkpoint``
stores each rank's position and ``load_checkpoint`` restores it when the world size matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class ResumableLoader:
    """Iterate ``loader`` epoch after epoch, counting batches.

    :param loader: a re-iterable loader. When it has a ``sampler`` with ``set_epoch`` (a
        ``DistributedSampler``), ``set_epoch`` is called at the start of every epoch, so a
        shuffled order is reproducible.

    Iterating yields the rest of the current epoch, then advances the epoch. After
    :meth:`load_state_dict`, the next iteration skips the batches already consumed (they are
    drawn and dropped: the order comes from the loader, which need not be indexable).
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.epoch = 0
        self.batches = 0  # consumed in the current epoch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        skip = self.batches
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            self.batches = i + 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches"}``: where the next batch comes from (an epoch consumed to its
        end counts as the start of the next)."""
        try:
            length = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            length = -1
        if self.batches == length:
            return {"epoch": self.epoch + 1, "batches": 0}
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a :meth:`state_dict` position."""
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])
