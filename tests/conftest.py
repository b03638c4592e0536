"""Shared test setup: the CPU backend is chosen explicitly (docs/architecture.md §3.1)."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
