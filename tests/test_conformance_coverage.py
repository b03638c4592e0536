"""Sentence coverage of the hook specs (issue 28 §1): the splitter, the table, CI's gate."""

from __future__ import annotations

import pytest
from ds_conformance import coverage as cov
from ds_conformance.marks import promise

from ds_core.cli import main
from ds_core.hookspecs._contract import unchecked, unchecked_of

# --------------------------------------------------------------------------- splitting


def test_sentences_cut_at_full_stops_but_not_in_code_or_abbreviations() -> None:
    doc = """Do one thing, e.g. ``x.y()``. Then ``z. Q`` stays whole; i.e. Not cut.

        :param a: first. Second of a.
        :raises ValueError: on bad ``a``.
        - bullet one. Bullet two
          continues here.
        Device context: never.
        """
    assert cov.sentences(doc) == [
        "Do one thing, e.g. ``x.y()``.",
        "Then ``z. Q`` stays whole; i.e. Not cut.",
        ":param a: first.",
        "Second of a.",
        ":raises ValueError: on bad ``a``.",
        "- bullet one.",
        "Bullet two continues here.",
        "Device context: never.",
    ]


def test_every_spec_owner_has_sentences() -> None:
    specs = cov.spec_sentences()
    assert {"hookspecs", "comm", "ds_comm_all_reduce", "ds_device_count"} <= set(specs)
    assert all(specs.values()), [o for o, s in specs.items() if not s]


# --------------------------------------------------------------------------- the table

SPECS = {"ds_x": ["Returns one.", ":raises ValueError: on two.", "Facade: ``x``."]}


def test_links_and_spec_entries_class_each_sentence() -> None:
    result = cov.compute(
        SPECS,
        links=[("cat/test_a", "ds_x", "Returns one"), ("cat/test_b", "ds_x", "ValueError")],
        entries=[("ds_x", "Facade:", "promises nothing: a name")],
    )
    assert [(r.status, r.checks) for r in result.rows] == [
        ("covered", ["cat/test_a"]),
        ("covered", ["cat/test_b"]),
        ("untestable", []),
    ]
    assert result.totals() == {
        "sentences": 3, "covered": 2, "untestable": 1, "uncovered": 0, "stale": 0,
    }  # fmt: skip
    assert cov.compute(SPECS, links=[], entries=[]).totals()["uncovered"] == 3


@pytest.mark.parametrize(
    ("links", "entries", "why"),
    [
        ([("c/t", "ds_x", "Returns two")], [], "no sentence"),
        ([("c/t", "ds_x", "e")], [], "3 sentences"),
        ([("c/t", "ds_gone", "Returns one")], [], "no hook spec"),
        ([], [("ds_x", "reworded", "promises nothing: x")], "no sentence"),
        ([("c/t", "ds_x", "Facade")], [("ds_x", "Facade", "promises nothing: x")], "checks it"),
    ],
)
def test_stale_links_and_entries_are_reported(
    links: list[tuple[str, str, str]], entries: list[tuple[str, str, str]], why: str
) -> None:
    result = cov.compute(SPECS, links=links, entries=entries)
    assert len(result.stale) == 1 and why in result.stale[0], result.stale


def test_spec_entries_need_a_reason_of_a_known_kind() -> None:
    with pytest.raises(ValueError, match="untestable because"):
        unchecked("Facade", "obvious")

    @unchecked("Facade", "promises nothing: the facade's name")
    def ds_x() -> None:
        """Facade: ``x``."""

    assert unchecked_of(ds_x) == [("Facade", "promises nothing: the facade's name")]
    with pytest.raises(TypeError, match="fragment"):
        promise("ds_x", " ")


def test_the_coverage_command_exits_non_zero_on_uncovered_or_stale(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = cov.compute
    monkeypatch.setattr(cov, "compute", lambda: real(SPECS, [], []))
    assert main(["conformance", "--coverage"]) == 1
    out, err = capsys.readouterr()
    assert "| ds_x | Returns one. | **UNCOVERED** |" in out and "uncovered: ds_x" in err
    done = [("c/t", "ds_x", s) for s in SPECS["ds_x"]]
    monkeypatch.setattr(cov, "compute", lambda: real(SPECS, done, []))
    assert main(["conformance", "--coverage"]) == 0
    assert (
        "sentences: 3, covered: 3, untestable: 0, uncovered: 0, stale: 0" in capsys.readouterr()[0]
    )
    monkeypatch.setattr(cov, "compute", lambda: real(SPECS, [*done, ("c/t", "ds_x", "zz")], []))
    assert main(["conformance", "--coverage"]) == 1


# --------------------------------------------------------------------------- the suite's state


def test_every_sentence_is_checked_or_classed_and_no_link_is_stale() -> None:
    """CI's gate: every mark and spec entry names one sentence, and no sentence of the hook
    specs is uncovered (link a check with ``@promise`` or class it in the spec)."""
    result = cov.compute()
    assert result.stale == [], "stale promise links or spec entries"
    assert result.uncovered() == [], "uncovered sentences: link a check or class them in the spec"


def test_running_the_suite_still_needs_a_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance"]) == 2
    assert "--backend NAME is required" in capsys.readouterr().err
