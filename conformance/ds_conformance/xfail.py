"""The backend's expected-failure file, ``conformance-xfail.txt`` at its package's root.

One entry a line: ``group/test_name[params]  reason``. ``#`` starts a comment. An entry
without ``[params]`` matches every parametrisation of the test. Entries that match no
collected test are stale: they warn, and fail the run under ``--ds-strict``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "conformance-xfail.txt"


@dataclass(frozen=True)
class XfailEntry:
    """One line of the file: the test id (or id prefix without params) and why it fails."""

    test_id: str
    reason: str
    line: int

    def matches(self, test_id: str) -> bool:
        if test_id == self.test_id:
            return True
        return "[" not in self.test_id and test_id.split("[", 1)[0] == self.test_id


def parse(text: str, source: str = FILE_NAME) -> list[XfailEntry]:
    """Parse the file's text.

    :raises ValueError: naming ``source`` and the line, when an id is not ``group/test``.
    """
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        parts = line.split(None, 1)
        test_id = parts[0]
        reason = parts[1].strip() if len(parts) > 1 else "no reason given"
        if "/" not in test_id or not test_id.split("/", 1)[1]:
            raise ValueError(
                f"{source}:{number}: {test_id!r} is not a test id; write "
                f"'group/test_name[params]  reason' (e.g. 'comm/test_all_reduce[sum-int16-w2]  "
                f"gloo lacks int16')"
            )
        entries.append(XfailEntry(test_id, reason, number))
    return entries


def backend_file(plugin_module: str) -> Path | None:
    """The xfail file at the root of the package holding ``plugin_module``, if it exists."""
    top = plugin_module.split(":", 1)[0].split(".", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin:
        root = Path(spec.origin).parent
    else:
        return None
    path = root / FILE_NAME
    return path if path.is_file() else None
