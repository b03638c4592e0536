"""Process hygiene: probes touch no device, processes can fork after a probe, Ctrl+C is kept.

What the probe checks can see (run in a fresh interpreter, after ``import torch, ds_core``):
new top-level modules that are neither the standard library, torch, ds_core nor a ds_core
backend package (its own or another) must be listed in ``ProbeResult.imported``; the probe must start no
OS thread (device runtimes start workers when they create a context, and threads make a later
``fork()`` unsafe); ``torch.<device type>.is_initialized()`` and ``torch.cuda.is_initialized()``
must stay false where they exist (not on ``cpu``, which has no context); and no driver
library (``libcuda.so``) may be newly mapped. A runtime that creates a context silently,
without threads, libraries or a torch flag, is beyond what a Python suite can observe.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from ds_conformance.helpers import SNAPSHOT, check, run_python, undocumented_modules
from ds_conformance.marks import hooks, promise, tier

pytestmark = tier("basic")


#: Hooks whose spec says "Device context: never" (query hooks that only describe, and the comm
#: library's registration), with the arguments the probe script calls them with.
NEVER_HOOKS: tuple[tuple[str, str], ...] = (
    ("ds_backend_info", "()"),
    ("ds_backend_capabilities", "()"),
    (
        "ds_device_count",
        "()",
    ),  # "must not create one where the vendor offers a count that does not"
    ("ds_comm_backend_name", "()"),
    ("ds_launcher_visible_devices_env", "()"),
    ("ds_launcher_env_prefixes", "()"),
    ("ds_memory_is_pinned", "(torch.zeros(4),)"),
    ("ds_memory_empty_cache", "()"),  # "never creates one; a no-op on a device that has none"
    ("ds_op_providers", "()"),  # and each provider's status()
    # Last: what it registers stays registered, so a context it made would also be charged
    # to every hook after it.
    ("ds_comm_prepare", "()"),
)


def _probe_script(acc: Any) -> str:
    hooks_list = ", ".join(f"({h!r}, {a})" for h, a in NEVER_HOOKS)
    return (
        SNAPSHOT
        + f"NEVER_HOOKS = [{hooks_list}]\n"
        + f"""
import importlib.metadata as md
before = snapshot()
env0, torch0 = dict(os.environ), (torch.get_num_threads(), str(torch.get_default_dtype()),
                                  torch.are_deterministic_algorithms_enabled())
ep = next(e for e in md.entry_points(group="ds_core.backends") if e.name == {acc.name!r})
plugin = ep.load()
probe = plugin.ds_backend_probe()
info = plugin.ds_backend_info()
result = diff(before, info.device_type)
# Other ds_core backend packages obey these same rules; importing one is not a vendor import.
backends = sorted(set(e.value.split(":")[0].split(".")[0]
                       for e in md.entry_points(group="ds_core.backends")))
env1 = dict(os.environ)
torch1 = (torch.get_num_threads(), str(torch.get_default_dtype()),
          torch.are_deterministic_algorithms_enabled())
result.update(env_changed=sorted(k for k in set(env0) | set(env1) if env0.get(k) != env1.get(k)),
              torch_settings=[list(torch0), list(torch1)])
result.update(available=probe.available, imported=list(probe.imported),
              own=ep.value.split(":")[0].split(".")[0], backends=backends)
# The hooks whose spec says "Device context: never", called after the probe as a user's first
# calls would be; what they changed is measured from here.
before = snapshot()
never = dict()
for hook, args in NEVER_HOOKS:
    impl = getattr(plugin, hook, None)
    if impl is not None:
        out = impl(*args)
        if hook == "ds_op_providers":
            result.update(statuses=[type(p.status()).__name__ for p in out if hasattr(p, "status")])
        never[hook] = diff(before, info.device_type)
result.update(never=never)
print(json.dumps(result))
"""
    )


@pytest.fixture(scope="module")
def probe_effects(acc: Any, request: pytest.FixtureRequest) -> dict[str, Any]:
    from ds_conformance.plugin import suite_of

    # From the environment before this run's own selection probed the backend.
    base = suite_of(request.config).env_at_start
    return run_python(_probe_script(acc), base_env=base)  # type: ignore[no-any-return]


@hooks("ds_backend_probe", "ds_backend_info")
@promise("ds_backend_probe", "``imported`` lists vendor modules imported.")
@promise("ds_backend_info", "``vendor_version`` is read from package metadata, never by importing")
def test_probe_imports_only_documented_modules(probe_effects: dict[str, Any]) -> None:
    documented = {m.split(".")[0] for m in probe_effects["imported"]} | {probe_effects["own"]}
    documented |= set(probe_effects["backends"])
    extra = undocumented_modules(probe_effects, documented)
    check(
        not extra,
        "modules imported by import + probe",
        extra,
        f"only those in ProbeResult.imported={probe_effects['imported']}",
        "ds_backend_probe()",
    )


@hooks("ds_backend_probe")
@promise(
    "ds_backend_probe",
    "Report whether this backend can run on this host, without touching a device.",
)
@promise("ds_backend_probe", "never a call that initialises the device runtime")
@promise("ds_backend_probe", "Device context: never.")
@promise("backend", "so none of them may create a device context")
@promise("hookspecs", "Only ``ds_backend_*`` hooks are called before selection")
def test_probe_creates_no_device_context(probe_effects: dict[str, Any]) -> None:
    check(
        not probe_effects["contexts"],
        "device contexts",
        probe_effects["contexts"],
        "none",
        "import + ds_backend_probe()",
    )
    check(
        probe_effects["new_threads"] <= 0,
        "OS threads started",
        probe_effects["new_threads"],
        "0 (a runtime's workers mean a context; fork() after them is unsafe)",
        "import + ds_backend_probe()",
    )
    check(
        not probe_effects["new_driver_libs"],
        "driver libraries loaded",
        probe_effects["new_driver_libs"],
        "none",
        "import + ds_backend_probe()",
    )


def _never_promises(fn: Any) -> Any:
    for hook, _ in NEVER_HOOKS:
        said = "must not create one" if hook == "ds_device_count" else "never"
        fn = promise(hook, f"Device context: {said}")(fn)
    return fn


@pytest.mark.parametrize("hook", [h for h, _ in NEVER_HOOKS])
@_never_promises
@promise("ds_op_providers", "A provider may also have ``status() -> str``")
@promise("ds_op_providers", "``status`` may run the toolchain probe but must not build or touch")
@hooks(*(h for h, _ in NEVER_HOOKS))
def test_a_hook_that_never_needs_a_device_context_creates_none(
    probe_effects: dict[str, Any], hook: str
) -> None:
    effects = probe_effects["never"].get(hook)
    if effects is None:
        pytest.skip(f"the backend's plugin has no {hook} (an optional hook left out)")
    if hook == "ds_op_providers":
        bad = [t for t in probe_effects.get("statuses", []) if t != "str"]
        check(not bad, "types of the providers' status()", bad, "str", "OpProvider.status()")
        hook = "ds_op_providers() + each provider's status()"
    call = f"import + ds_backend_probe() + {hook}() and the hooks before it"
    check(not effects["contexts"], "device contexts", effects["contexts"], "none", call)
    check(effects["new_threads"] <= 0, "OS threads started", effects["new_threads"],
          "0 (a runtime's workers mean a context)", call)  # fmt: skip
    check(not effects["new_driver_libs"], "driver libraries loaded", effects["new_driver_libs"],
          "none", call)  # fmt: skip


@hooks("ds_backend_probe", "ds_backend_info")
def test_probe_leaves_environment_and_torch_settings_unchanged(
    probe_effects: dict[str, Any],
) -> None:
    """Discovery probes every installed backend: one that sets a variable (thread counts,
    visible devices) or a torch setting changes the process for whichever backend wins."""
    check(
        not probe_effects["env_changed"],
        "environment variables changed",
        probe_effects["env_changed"],
        "none",
        "import + ds_backend_probe() + ds_backend_info()",
    )
    before, after = probe_effects["torch_settings"]
    check(
        before == after,
        "torch (num_threads, default dtype, deterministic algorithms)",
        after,
        f"unchanged: {before}",
        "import + ds_backend_probe() + ds_backend_info()",
    )


@hooks("ds_backend_probe")
def test_backend_works_in_a_child_forked_after_the_probe(acc: Any) -> None:
    result = run_python(
        f"""
        import json, os, time, torch, traceback
        import importlib.metadata as md
        ep = next(e for e in md.entry_points(group="ds_core.backends") if e.name == {acc.name!r})
        ep.load().ds_backend_probe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                from ds_core import get_accelerator
                acc = get_accelerator()
                x = torch.arange(8, dtype=torch.float32, device=acc.device())
                total = (x * 2).sum().item()
                acc.synchronize()
                code = 0 if total == 56.0 else 3
            except BaseException:
                traceback.print_exc()
                code = 4
            os._exit(code)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print(json.dumps({{"exit": os.waitstatus_to_exitcode(status)}}))
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                print(json.dumps({{"exit": "hung"}}))
                break
            time.sleep(0.05)
        """
    )
    check(
        result["exit"] == 0,
        "forked child's exit",
        result["exit"],
        "0 (computed 56.0 on the device)",
        "probe; fork(); use the backend in the child",
    )


def _interrupt_at(n: int, fn: Callable[[], Any]) -> tuple[int, bool]:
    """Call ``fn`` raising KeyboardInterrupt at its ``n``-th Python call; return (calls, raised)."""
    calls = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal calls
        if event == "call":
            calls += 1
            if calls == n:
                raise KeyboardInterrupt(f"ds_conformance: injected at call {n}")
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    except KeyboardInterrupt:
        return calls, True
    finally:
        sys.settrace(previous)
    return calls, False


# Interrupt points tried per call: enough to reach the handlers of a typical check or build.
MAX_POINTS = 40


@hooks("ds_op_providers")
@promise(
    "ds_op_providers",
    "Calling this hook and ``is_compatible`` must not build, load, or touch a device",
)
def test_keyboard_interrupt_in_op_check_or_build_propagates(acc: Any) -> None:
    providers = acc.op_providers()
    if not providers:
        pytest.skip(f"backend '{acc.name}' lists no op providers")
    for provider in providers:
        ok, _ = provider.is_compatible()
        steps: list[tuple[str, Callable[[], Any]]] = [("is_compatible", provider.is_compatible)]
        if ok:
            steps.append(("load", provider.load))
        for label, fn in steps:
            total, _ = _interrupt_at(0, fn)  # count the calls without interrupting
            for n in range(1, min(total, MAX_POINTS) + 1):
                ran, raised = _interrupt_at(n, fn)
                if not raised and ran < n:
                    break  # this call made fewer Python calls (a cache hit): nothing injected
                check(
                    raised,
                    f"KeyboardInterrupt injected at Python call {n} of {label}",
                    "swallowed",
                    "propagated to the caller",
                    f"get_op({provider.name!r}).{label}()",
                )
