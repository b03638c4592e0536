"""Shared test setup: the CPU backend is chosen explicitly (DESIGN.md §3, Selection)."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
