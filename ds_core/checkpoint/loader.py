"""A data loader that knows its position, so a checkpoint can resume mid-epoch.

``initialize(training_data=...)`` returns one, already set as ``engine.training_dataloader``;
wrap any other re-iterable loader whose order depends only on its epoch and set it there
yourself. ``save_checkpoint`` stores each rank's position and ``load_checkpoint`` restores it
when the world size matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class ResumableLoader:
    """Iterate ``loader`` epoch after epoch, counting batches.

    :param loader: a re-iterable loader. Other attributes (``sampler``, ``dataset``,
        ``batch_size``, ...) are the wrapped loader's.
    :param set_epoch: when the loader has a ``sampler`` with ``set_epoch`` (a
        ``DistributedSampler``), call it at the start of every epoch, so each epoch has its
        own reproducible order. ``initialize()`` passes ``False``: DeepSpeed's loader keeps
        one order unless the script calls ``loader.sampler.set_epoch(epoch)`` itself.

    Iterating yields the rest of the current epoch, then advances the epoch. After
    :meth:`load_state_dict`, the next iteration skips the batches already consumed (they are
    drawn and dropped: the order comes from the loader, which need not be indexable).
    """

    def __init__(self, loader: Iterable[Any], set_epoch: bool = True) -> None:
        if isinstance(loader, ResumableLoader):
            raise TypeError("the loader already is a ResumableLoader; use it as it is")
        self.loader = loader
        self.set_epoch = set_epoch
        self.epoch = 0
        self.batches = 0  # consumed in the current epoch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.loader, "sampler", None)
        if self.set_epoch and sampler is not None and hasattr(sampler, "set_epoch"):
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
