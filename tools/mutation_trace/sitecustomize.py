"""Line tracing for the mutation tool's coverage run (``tools/conformance_mutation.py``).

Put first on ``PYTHONPATH`` only by that run, with ``DS_MUT_TRACE_DIR`` (where each process
appends its records) and ``DS_MUT_TRACE_PKG`` (the package directory whose lines are traced).
Each process appends ``context<TAB>file<TAB>line`` the first time a line runs under a context,
straight to its own file (so a process that ends by ``os._exit`` or a signal keeps what it had
recorded). The context is the running check's id, set by the run's pytest plugin and inherited
by the processes a check starts (``DS_MUT_CONTEXT``); a conformance rank worker instead records
each collective case under ``case:<key>`` and everything else under the empty context, which the
tool reads as "every check" (as it reads lines run at import or in shared fixtures).
"""

from __future__ import annotations

import os
import sys
import threading

_DIR = os.environ.get("DS_MUT_TRACE_DIR")
_PKG = os.environ.get("DS_MUT_TRACE_PKG")
context = os.environ.get("DS_MUT_CONTEXT", "")


def set_context(name: str) -> None:
    """Lines run from now on (in this process and in processes it starts) belong to ``name``."""
    global context
    context = name
    os.environ["DS_MUT_CONTEXT"] = name


def _install(directory: str, package: str) -> None:
    global context
    fd = os.open(
        os.path.join(directory, f"trace-{os.getpid()}.tsv"),
        os.O_WRONLY | os.O_CREAT | os.O_APPEND,
        0o644,
    )
    seen: set[tuple[str, str, int]] = set()
    wanted: dict[object, bool] = {}
    prefix = os.path.join(os.path.realpath(package), "")

    def line(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line":
            key = (context, frame.f_code.co_filename, frame.f_lineno)
            if key not in seen:
                seen.add(key)
                os.write(fd, f"{key[0]}\t{key[1][len(prefix) :]}\t{key[2]}\n".encode())
        return line

    def case_scope(frame, event, arg):  # type: ignore[no-untyped-def]
        global context
        if event == "return":
            context = ""
        return case_scope

    def call(frame, event, arg):  # type: ignore[no-untyped-def]
        global context
        code = frame.f_code
        hit = wanted.get(code)
        if hit is None:
            hit = wanted[code] = os.path.realpath(code.co_filename).startswith(prefix)
        if hit:
            line(frame, "line", arg)  # the first line (a def's decorators/defaults, a body)
            return line
        name = code.co_name
        if name == "main" and code.co_filename.endswith("_rank_worker.py"):
            context = ""  # group set-up serves every case of the group
        elif name == "run_case" and code.co_filename.endswith("comm_cases.py"):
            context = f"case:{frame.f_locals['case'].key}"
            return case_scope
        return None

    sys.settrace(call)
    threading.settrace(call)


if _DIR and _PKG:
    _install(_DIR, _PKG)
