"""Cost of one hook call: direct call on the backend vs the facade vs pluggy's hook caller.

Run: ``python bench/dispatch.py`` (selects the CPU backend unless ``DS_ACCELERATOR`` says
otherwise). Prints ns per call (best of 7 repeats of 200k calls) and the ratios to the direct
call. Never asserts; the target (facade ≤ 1.5× direct for a hot hook) is read off the output.
"""

from __future__ import annotations

import os
import timeit

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import ds_core


def ns_per_call(stmt: str, env: dict[str, object], number: int = 200_000) -> float:
    times = timeit.Timer(stmt, globals=env).repeat(repeat=7, number=number)
    return min(times) / number * 1e9


def main() -> None:
    acc = ds_core.get_accelerator()
    env = {"backend": acc.entry.plugin, "acc": acc, "hook": acc._pm.hook}
    cases = [
        # (label, direct, facade, pluggy)
        (
            "current_device()",
            "backend.ds_device_current()",
            "acc.current_device()",
            "hook.ds_device_current()",
        ),
        (
            "current_stream()",
            "backend.ds_stream_current(None)",
            "acc.current_stream()",
            "hook.ds_stream_current(index=None)",
        ),
        (
            "stream(s)",
            "backend.ds_stream_use(None)",
            "acc.stream(None)",
            "hook.ds_stream_use(stream=None)",
        ),
    ]
    print(f"backend: {acc.name}   ns per call, best of 7 x 200k")
    print(
        f"{'hook':<18} {'direct':>8} {'facade':>8} {'pluggy':>8} {'facade/direct':>14} {'pluggy/direct':>14}"
    )
    for label, direct, facade, pluggy in cases:
        d, f, p = (ns_per_call(s, env) for s in (direct, facade, pluggy))
        print(f"{label:<18} {d:8.0f} {f:8.0f} {p:8.0f} {f / d:14.2f} {p / d:14.2f}")
    print(
        "\ncurrent_device() and stream(s) are bound to the implementation itself; "
        "current_stream() is a typed facade method adding the default index."
    )


if __name__ == "__main__":
    main()
