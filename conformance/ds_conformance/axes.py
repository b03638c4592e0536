"""Edge axes (issue 28 §2): each axis written once here, applied to every hook it concerns.

The hook lists are derived from the hook specs (:mod:`ds_core.hookspecs`), not written out, so a
hook added to a category is checked on every axis its signature or its kind puts it on. The
``test_*_axes`` modules parametrise their checks over these lists; each declares the category
it belongs to (``CATEGORY``), so ``--category stream`` runs the stream axes too.

Queued work: a check of ordering needs work that really waits in a queue. Compute may run at
once on some devices (the simulated accelerator runs kernels on the host at the call, after the
current stream's queued work), so the producer here is a device-to-device copy, which every
asynchronous device queues (as ``cudaMemcpyAsync`` is), issued after a chain of kernels that
keeps a real device's stream busy past the call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ds_core.hookspecs import SPEC_MODULES

#: Elements of a queued copy: large enough that a real device's copy outlasts the call.
COPY_NUMEL = 1 << 20


def spec_hooks(category: str | None = None) -> dict[str, Callable[..., Any]]:
    """Hook name -> spec function, in spec order; only ``category``'s when given."""
    out: dict[str, Callable[..., Any]] = {}
    for module in SPEC_MODULES:
        if category is not None and module.__name__.rsplit(".", 1)[1] != category:
            continue
        for name, fn in vars(module).items():
            if name.startswith("ds_") and callable(fn):
                out[name] = fn
    return out


def hooks_with_argument(argument: str, category: str | None = None) -> list[str]:
    """Hooks whose spec signature has a parameter named ``argument``."""
    return [
        name
        for name, fn in spec_hooks(category).items()
        if argument in inspect.signature(fn).parameters
    ]


def source(acc: Any, salt: float = 0.0) -> torch.Tensor:
    """A device tensor of :data:`COPY_NUMEL` known values, complete on the device when this
    returns (the host waits for it), so only the copies made from it are in flight."""
    src = torch.arange(COPY_NUMEL, dtype=torch.float32, device=acc.device()) + salt
    acc.synchronize()
    return src


def expected(salt: float = 0.0) -> torch.Tensor:
    """What :func:`source` holds, on the host."""
    return torch.arange(COPY_NUMEL, dtype=torch.float32) + salt


def queue_copy(acc: Any, stream: Any, src: torch.Tensor) -> torch.Tensor:
    """A new device tensor filled from ``src`` by a copy queued on ``stream`` (its contents are
    defined only for work ordered after that copy)."""
    with acc.stream(stream):
        busy = torch.ones(1 << 16, device=src.device)
        for _ in range(8):  # a real device's stream is still busy when the copy is issued
            busy = busy * 1.0001
        dst = torch.empty_like(src)
        dst.copy_(src)
    return dst


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """``"equal"``, or where and how ``got`` (any device) first differs from ``want`` (host)."""
    host = got.cpu()
    if torch.equal(host, want):
        return "equal"
    wrong = (host != want).nonzero().flatten()
    if wrong.numel() == 0:
        return f"shape {tuple(host.shape)} vs {tuple(want.shape)}"
    i = int(wrong[0])
    return f"{wrong.numel()} elements differ, first [{i}]={host[i].item()} (want {want[i].item()})"


# -- state objects ----------------------------------------------------------------------------

#: Return annotations of the hooks whose result is a state object (not a count, a flag, a
#: stream or a generator, which are handles onto the backend by design).
STATE_RETURNS: frozenset[str] = frozenset(
    {"dict[str, int]", "MemoryInfo", "DeviceProperties", "torch.Tensor"}
)
#: The promise the state-object axis checks (``ds_core/hookspecs/__init__.py``).
STATE_PROMISE = "An object a query hook returns (a statistics dict"
#: A key no backend reports, planted in a returned mapping.
PLANTED = "ds_conformance_planted"


def state_hooks(category: str) -> list[str]:
    """``category``'s hooks that take a device ``index`` and return a state object."""
    return [
        name
        for name, fn in spec_hooks(category).items()
        if "index" in inspect.signature(fn).parameters
        and str(inspect.signature(fn).return_annotation) in STATE_RETURNS
    ]


def _call(acc: Any, hook: str, index: int | None) -> Any:
    spec = spec_hooks()[hook]
    args = [index if p == "index" else None for p in inspect.signature(spec).parameters]
    return getattr(acc._h, hook)(*args)


def _snapshot(value: Any) -> Any:
    """A deep, comparable copy of a state object."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return dict(value)
    extra = getattr(value, "extra", None)
    return (value, dict(extra) if extra is not None else None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def _activity(acc: Any) -> None:
    """Device work that changes what state hooks report: allocation, draws, a peak reset."""
    t = torch.rand(1 << 18, device=acc.device())
    t = t * 2
    acc.manual_seed(1234)
    torch.rand(16, device=acc.device())
    acc.synchronize()
    del t
    acc.reset_peak_memory_stats()
    acc.empty_cache()


def _plant(value: Any) -> bool:
    """Change a returned object in place where it is mutable; whether it was changed."""
    if isinstance(value, torch.Tensor):
        value.zero_()
        return True
    target = value if isinstance(value, dict) else getattr(value, "extra", None)
    if isinstance(target, dict):
        target[PLANTED] = 1
        return True
    return False


def check_state_object(acc: Any, hook: str, check: Callable[..., None]) -> None:
    """The state-object axis for ``hook``: its result is unchanged by later device work, and
    changing it changes nothing the backend reports next."""
    before = _call(acc, hook, None)
    kept = _snapshot(before)
    _activity(acc)
    check(
        _same(_snapshot(before), kept),
        f"{hook}(None)'s earlier result after device work",
        "changed",
        "unchanged (the caller's copy)",
        hook,
    )
    ours = _call(acc, hook, None)
    fresh = _snapshot(ours)
    if not _plant(ours):
        return
    again = _call(acc, hook, None)
    if isinstance(again, torch.Tensor):
        leaked = not torch.equal(again, fresh)
    else:
        mapping = again if isinstance(again, dict) else getattr(again, "extra", {})
        leaked = PLANTED in mapping
    check(not leaked, f"{hook}(None) after the caller changed its last result", "changed too",
          "unaffected", hook)  # fmt: skip


# -- integer ranges ---------------------------------------------------------------------------

#: The version of the contract that states the range rules (``ds_core/hookspecs``).
RANGES_SINCE = 3
#: The shared rules the range axes check (the package docstring of ``ds_core.hookspecs``).
INDEX_RULE = "An ``index`` typed ``int | None`` is ``None`` (the current device)"
SEED_RULE = "A ``seed`` is an ``int`` in ``range(2**64)``."
PRIORITY_RULE = "A stream ``priority`` is any ``int``"
RANGE_ERRORS = "An ``int`` out of range raises ``ValueError`` naming the range"
#: Arguments of another type than ``int`` (``None`` only where the type has no ``None``).
NOT_INTS: tuple[object, ...] = ("0", 0.0, 1.0, True, False)


def out_of_range(count: int) -> tuple[int, ...]:
    """Indices outside ``range(count)``: just out at each end, then further out (a check of
    ``index != count`` for ``index < count`` passes the first two and accepts ``count + 1``)."""
    return (-1, count, -2, count + 1, 2**31)


def index_hooks() -> list[str]:
    """Every hook with an ``index: int | None`` argument (``ds_device_set``'s is never None)."""
    return [
        name
        for name, fn in spec_hooks().items()
        if "index" in inspect.signature(fn).parameters
        and str(inspect.signature(fn).parameters["index"].annotation) == "int | None"
    ]


def call_with_index(acc: Any, hook: str, index: object) -> Any:
    """Call ``hook`` directly with ``index`` and valid other arguments: a generator state of
    the device ``index`` names (of the current one when it names none), priority 0."""
    own = index if isinstance(index, int) and not isinstance(index, bool) else None
    try:
        state = acc._h.ds_rng_get_state(own)
    except (TypeError, ValueError):
        state = acc._h.ds_rng_get_state(None)
    values = {"index": index, "state": state, "priority": 0}
    params = inspect.signature(spec_hooks()[hook]).parameters
    return getattr(acc._h, hook)(*(values[p] for p in params))


def skip_before_ranges(acc: Any) -> None:
    """Skip a range check for a backend targeting a contract older than the range rules."""
    import pytest

    version = acc.info.hookspec_version
    if version < RANGES_SINCE:
        pytest.skip(f"the backend targets hook spec version {version}; the range rules are "
                    f"version {RANGES_SINCE}'s")  # fmt: skip
