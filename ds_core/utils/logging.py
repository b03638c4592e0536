"""``deepspeed.utils.logging``: the library's logger and ``log_dist``.

``logger`` is the ``ds_core`` logger, the parent of every logger ds_core logs to, so
``logger.setLevel(...)`` (as transformers and Lightning call on DeepSpeed's) sets what
ds_core reports. Importing this module configures nothing: handlers and levels stay the
application's, as for any library logger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ds_core.comm import get_rank, is_initialized

__all__ = ["get_dist_msg", "log_dist", "logger"]

logger = logging.getLogger("ds_core")


def get_dist_msg(message: str, ranks: Sequence[int] | None = None) -> str | None:
    """``"[Rank r] message"`` when this rank should log it, else ``None``; DeepSpeed's rule:
    before ``init_distributed`` every process logs (as rank -1); after it, the ranks in
    ``ranks`` do (``[-1, ...]``: every rank; ``None`` or empty: none)."""
    if not is_initialized():
        return f"[Rank -1] {message}"
    rank = get_rank()
    ranks = list(ranks or [])
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` where :func:`get_dist_msg` says so."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)
