"""The bad-input corpus report (issue 29 §6): at the end of a run, the corpus's cases by
category with their outcomes (clear error or correct acceptance, unclear error, traceback,
silent wrong result). Its hooks are imported by tests/conftest.py.

A case is a test of the corpus's files (tests/test_bad_inputs*.py) or of the checkpoint and
interrupt tests listed in :data:`ELSEWHERE`. A failed case is a *traceback* when an exception
other than the one the case expects escaped, a *silent wrong result* when nothing was raised
where an error was due ("DID NOT RAISE") or an accepted input gave another result, and an
*unclear error* when the error came but lacks the words or type the case asks for.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

#: test file, or file::test, -> category (cases kept outside the corpus's files); a load at
#: another layout is a case whose right outcome is a correct load (docs/checkpoints.md)
ELSEWHERE = {
    "tests/checkpoint/test_corruption.py": "checkpoint",
    "tests/checkpoint/test_faults.py": "checkpoint",
    "tests/checkpoint/test_resume.py::test_load_errors_and_refusals": "checkpoint",
    "tests/pipe/test_pipe_checkpoint.py::test_bad_loads_name_the_value": "checkpoint",
    "tests/checkpoint/test_tp.py::test_native_save_of_a_tp_engine_is_refused": "checkpoint",
    "tests/checkpoint/test_ep.py::test_tp_ep_native_save_is_refused": "checkpoint",
    "tests/checkpoint/test_reshard.py::test_gathered_state_equals_saved": "checkpoint layout",
    "tests/checkpoint/test_reshard.py::test_continued_training_matches": "checkpoint layout",
    "tests/checkpoint/test_tp.py::test_fused_gqa_and_tied_vocab_parallel_checkpoint_reloads_at_tp1": "checkpoint layout",
    "tests/checkpoint/test_ep.py::test_tp_ep_checkpoint_loads_at_other_ep_and_tp_sizes": "checkpoint layout",
    "tests/test_interrupts.py": "interrupts",
}

#: (test function name prefix, category) for tests/test_bad_inputs.py, first match wins
_BY_TEST = (
    ("test_api_", "engine API"),
    ("test_nan_loss", "engine API"),
    ("test_bad_config_file", "config files"),
    ("test_odd_but_valid_config", "config files"),
    ("test_unreadable_config", "config files"),
    ("test_config_of_another", "config files"),
    ("test_bad_cli", "CLI"),
    ("test_cli_", "CLI"),
    ("test_new_backend", "CLI"),
    ("test_bad_launcher", "environment"),
    ("test_good_launcher", "environment"),
    ("test_bad_ds_accelerator", "environment"),
    ("test_the_example_refuses_a_bad_ds", "environment"),
    ("test_bad_sim_variable", "sim variables"),
    ("test_good_sim_variables", "sim variables"),
    ("test_interop_", "interop adapters"),
    ("test_bad_autotp", "AutoTP config"),
    ("test_autotp_", "AutoTP config"),
)

#: case-id prefix -> category, for the parametrised cases that mix kinds of input
_BY_CASE = (
    ("nvme_", "NVMe folders"),
    ("autoep_", "AutoEP config"),
    ("autotp_", "AutoTP config"),
)

COLUMNS = ("cases", "clear", "unclear error", "traceback", "silent wrong result")
_results: dict[str, Counter[str]] = {}


def category(item: pytest.Item) -> str | None:
    """The corpus category of ``item``, or ``None`` when it is not a corpus case."""
    path = item.nodeid.split("::", 1)[0]
    name = item.name.split("[", 1)[0]
    for key in (path, f"{path}::{name}"):
        if key in ELSEWHERE:
            return ELSEWHERE[key]
    case = item.name.partition("[")[2].rstrip("]")
    if path.startswith("tests/test_bad_inputs"):
        for prefix, cat in _BY_CASE:  # a case id may carry the backend: [cpu-nvme_...]
            if any(part.startswith(prefix) for part in case.split("-")):
                return cat
        for prefix, cat in _BY_TEST:
            if name.startswith(prefix):
                return cat
        if "checkpoint" in name:
            return "checkpoint"
        return "example flags"
    return None


def _outcome(report: pytest.TestReport, call: pytest.CallInfo[Any]) -> str:
    if report.passed:
        return "clear"
    exc = call.excinfo
    if exc is None:
        return "traceback"
    if "Traceback" in str(exc.value):  # a case that found one printed (a subprocess's)
        return "traceback"
    if "DID NOT RAISE" in str(exc.value) or "accepted" in report.nodeid:
        return "silent wrong result"
    if isinstance(exc.value, AssertionError | pytest.fail.Exception):  # type: ignore[misc]
        return "unclear error"
    return "traceback"


#: the user property that carries a case's (category, outcome) from the process that ran it
#: (an xdist worker) to the one that prints the table
PROPERTY = "bad_input_case"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """Tag each corpus case's call-phase report (a setup failure counts too) with its outcome."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    cat = category(item)
    if cat is None or report.skipped:
        return
    if call.when == "call" or (call.when == "setup" and report.failed):
        report.user_properties.append((PROPERTY, (cat, _outcome(report, call))))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count the tagged reports where the run's summary is printed."""
    for name, value in report.user_properties:
        if name == PROPERTY:
            cat, outcome = value
            counts = _results.setdefault(cat, Counter())
            counts["cases"] += 1
            counts[outcome] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the corpus's table when any case ran."""
    if not _results:
        return
    tr = terminalreporter
    tr.section("bad-input corpus (issue 29 §6)")
    width = max(len("category"), *(len(c) for c in _results)) + 2
    tr.write_line("category".ljust(width) + "  ".join(COLUMNS))
    total: Counter[str] = Counter()
    for cat in sorted(_results):
        total.update(_results[cat])
        tr.write_line(cat.ljust(width) + _row(_results[cat]))
    tr.write_line("total".ljust(width) + _row(total))


def _row(counts: Counter[str]) -> str:
    return "  ".join(str(counts[c]).rjust(len(c)) for c in COLUMNS)
