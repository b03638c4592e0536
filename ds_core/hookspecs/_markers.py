"""The pluggy markers of the ``ds_core`` project."""

from __future__ import annotations

import pluggy

PROJECT = "ds_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
