"""Probe helpers: a fork-safe probe cache and checks that never import or initialise a vendor stack.

Everything here is safe to call from ``ds_backend_probe``: it reads the file system, the
environment and installed-package metadata only.
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence

from ds_core.types import ProbeResult


class ProbeCache:
    """Run a probe once per process and keep its result.

    A forked child probes again (the result is keyed by process id): a launcher may fork and
    then narrow the visible-devices variables, and the child's answer must follow its own
    environment. The lock is re-created in the child, since a fork taken while another thread
    held it would leave it locked forever. A probe that raises becomes an unavailable result
    naming the exception; ``KeyboardInterrupt`` propagates.

    :param probe: the uncached probe; must not create a device context.
    """

    def __init__(self, probe: Callable[[], ProbeResult]) -> None:
        self._probe = probe
        self._lock = threading.Lock()
        self._result: tuple[int, ProbeResult] | None = None
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def __call__(self) -> ProbeResult:
        cached = self._result
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        with self._lock:
            try:
                result = self._probe()
            except Exception as exc:  # a broken probe reports, it never breaks discovery
                result = ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
            self._result = (os.getpid(), result)
            return result

    def clear(self) -> None:
        """Forget the cached result (tests, or after changing the environment on purpose)."""
        self._result = None


def module_present(name: str) -> bool:
    """Whether top-level module ``name`` is installed, without importing it.

    :raises ValueError: for a dotted name, because ``find_spec`` would import its parents.
    """
    if "." in name:
        raise ValueError(f"module_present takes a top-level name, got {name!r}")
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a half-installed package, or a spec-less module
        return False


def count_device_nodes(pattern: str) -> int:
    """Number of device files matching a glob (e.g. per-device nodes a driver creates)."""
    return len(glob.glob(pattern))


def visible_device_count(variables: Sequence[str], found: int) -> int:
    """Devices left visible by the first of ``variables`` that is set, capped by ``found``.

    An empty value hides every device; an unset variable leaves ``found`` unchanged.
    """
    for var in variables:
        value = os.environ.get(var)
        if value is None:
            continue
        entries = [v for v in value.split(",") if v.strip()]
        return min(len(entries), found)
    return found


def dist_version(*distributions: str) -> str:
    """Version of the first installed distribution among ``distributions``, else ``""``."""
    for name in distributions:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return ""


def package_file_present(package: str, *parts: str) -> bool:
    """Whether the installed top-level ``package`` ships the file ``parts``, without importing it.

    Lets a capability or op-compatibility check ask "does this vendor release have module X"
    before the vendor stack may be imported (``find_spec`` on a dotted name would import the
    parents, which for a vendor stack may load its runtime).

    :param package: a top-level package name.
    :param parts: path components below the package directory, e.g. ``("optim", "adam.py")``.
    :raises ValueError: for a dotted ``package``.
    """
    if "." in package:
        raise ValueError(f"package_file_present takes a top-level name, got {package!r}")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a half-installed package, or a spec-less module
        return False
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.exists(os.path.join(root, *parts)) for root in roots)
