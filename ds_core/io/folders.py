"""Swap folders of NVMe offload: ``<nvme_path>/ds_core_swap/<name>``, one per rank and kind,
sharing a parent that the last one to leave removes."""

from __future__ import annotations

import os
import shutil

from ds_core.comm import liveness
from ds_core.errors import ConfigError

#: the folder under ``nvme_path`` holding every rank's swap folder.
PARENT = "ds_core_swap"
#: tries to create a swap folder: another rank removing the shared parent (empty after its
#: own folder went) between our creating it and our child is a race, not an error.
_TRIES = 8


def make_swap_folder(nvme_path: str, name: str, field: str) -> str:
    """Create ``<nvme_path>/ds_core_swap/<name>`` (mode 0700) and return its absolute path.

    :param field: the config field named in errors (``offload_optimizer.nvme_path``, ...).
    :raises ConfigError: the folder cannot be created, or is not writable.
    """
    folder = os.path.join(os.path.abspath(nvme_path), PARENT, name)
    for attempt in range(_TRIES):
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            break
        except FileNotFoundError as exc:
            if attempt + 1 < _TRIES and os.path.isdir(nvme_path):
                continue  # the shared parent was removed by a rank leaving: create it again
            raise _cannot_create(field, folder, exc) from exc
        except OSError as exc:
            raise _cannot_create(field, folder, exc) from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{field}: the swap folder {folder} is not writable by this process; choose a "
            "writable folder on a local disk"
        )
    # A rank the liveness watchdog ends (os._exit, no finally) still removes its folder.
    liveness.on_abort(folder, lambda: remove_swap_folder(folder))
    return folder


def _cannot_create(field: str, folder: str, exc: OSError) -> ConfigError:
    return ConfigError(
        f"{field}: cannot create the swap folder {folder}: {exc.strerror or exc}; choose a "
        "writable folder on a local disk"
    )


def remove_swap_folder(folder: str) -> None:
    """Remove ``folder`` and, when no other rank's folder is left in it, the shared parent."""
    liveness.on_abort(folder, None)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(folder))
    except OSError:
        pass  # another rank's folder is still there (or the parent is gone already)
