"""The runner's mechanics, whatever the contract: timeouts, messages, repros, seeds, reports."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from posttrain.conformance import Status, check
from posttrain.conformance.outcome import report_schema
from posttrain.conformance.runner import Session, target_of
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import RingBuffer
from tests.paths import ROOT

pytest_plugins = ["pytester"]

SPECS = ROOT / "specs"


_RELEASE = threading.Event()


class _HangingSample(RingBuffer):
    """Waits for data (until the test releases it) instead of raising on an empty buffer."""

    def sample(self, batch_size: Any) -> Any:
        if len(self) == 0:
            _RELEASE.wait()
        return super().sample(batch_size)


class _Crashes(RingBuffer):
    def sample(self, batch_size: Any) -> Any:
        nothing: dict[str, Any] = {}
        return nothing["no such key"]


HANGING = Implementation("buffer", _HangingSample, name="tests.HangingSample")
CRASHES = Implementation("buffer", _Crashes, name="tests.Crashes")
DRAWS: list[float] = []


def _draws_at_construction(capacity: int) -> RingBuffer:
    DRAWS.append(float(torch.rand(())))
    return RingBuffer(capacity)


RECORDS_DRAWS = Implementation("buffer", _draws_at_construction, name="tests.RecordsDraws")


def _row(session: Session, req_id: str) -> Any:
    return session.run_one(session.contract.requirement(req_id))


def test_a_hang_is_a_failure_within_the_timeout() -> None:
    s = Session(HANGING, timeout_s=0.5)
    try:
        row = _row(s, "BUF-013")
    finally:
        _RELEASE.set()  # the abandoned check thread ends instead of outliving the test
    assert row.status is Status.FAIL
    assert row.message.startswith("BUF-013: no answer in 0.5 s")
    assert row.duration_s < 5
    # The session goes on, and the report is still written.
    assert _row(s, "BUF-004").status is Status.PASS  # a check done well within 0.5 s
    assert [r.id for r in s.report().results] == ["BUF-004", "BUF-013"]  # catalogue order


def test_failures_end_with_their_spec_anchor() -> None:
    from tests.mutants.buffers import MUTANTS

    row = _row(Session(MUTANTS["BUF-009"]), "BUF-009")
    assert row.status is Status.FAIL
    assert row.message.endswith("(see specs/buffer-v1.md#BUF-009)")
    assert row.spec == "specs/buffer-v1.md#BUF-009"
    assert (SPECS / "buffer-v1.md").read_text().count('<a id="BUF-009">') == 1


def test_an_error_says_whose_frame_raised() -> None:
    row = _row(Session(CRASHES), "BUF-004")
    assert row.status is Status.ERROR
    assert "raised KeyError: 'no such key'" in row.message
    assert "at tests/conformance/test_kit_mechanics.py:" in row.message
    assert "(implementation)" in row.message
    assert "called by the kit at posttrain/conformance/suites/buffer.py:" in row.message


def test_an_implementation_object_gets_a_repro_that_resolves() -> None:
    rep = check("buffer", CRASHES)
    row = {r.id: r for r in rep.results}["BUF-004"]
    assert f"--conformance-impl={target_of(CRASHES)} " in row.repro
    assert target_of(CRASHES) == "tests.conformance.test_kit_mechanics:CRASHES"
    loose = Implementation("buffer", RingBuffer, name="nowhere")
    assert target_of(loose) == ""
    assert (
        Session(loose)
        .repro(Session(loose).contract.requirement("BUF-001"))
        .startswith("no command")
    )


def test_a_rerun_of_one_requirement_draws_the_same_data() -> None:
    DRAWS.clear()
    whole = Session(RECORDS_DRAWS)
    for req in whole.requirements():
        if req.id in ("BUF-001", "BUF-002", "BUF-013"):
            whole.run_one(req)
    in_run = DRAWS[-1]  # BUF-013 builds one buffer, after the others drew
    DRAWS.clear()
    _row(Session(RECORDS_DRAWS), "BUF-013")
    assert [in_run] == DRAWS


def test_the_report_file_has_one_shape_and_matches_its_schema(tmp_path: Path) -> None:
    from posttrain.conformance.outcome import reports_json

    committed = json.loads((SPECS / "conformance-report-v1.schema.json").read_text())
    assert committed == report_schema()
    reps = [check("buffer", CRASHES), check("buffer", "posttrain.reference_impls:RING_BUFFER")]
    for some in (reps[:1], reps):
        data = json.loads(reports_json(some))
        jsonschema.validate(data, committed)
        assert len(data["reports"]) == len(some)
    assert [r.verdict() for r in reps] == ["does not conform", "conforms"]


def test_impl_without_contract_option_takes_the_declared_contract(
    pytester: pytest.Pytester,
) -> None:
    res = pytester.runpytest_inprocess(
        "--conformance-impl=posttrain.reference_impls:RING_BUFFER", "-k", "BUF-001 or BUF-013"
    )
    assert res.ret == 0
    res.assert_outcomes(passed=2, deselected=23)


def test_a_plain_factory_without_contract_option_is_a_usage_error(
    pytester: pytest.Pytester,
) -> None:
    res = pytester.runpytest_inprocess(
        "--conformance-impl=posttrain.reference_impls:make_ring_buffer"
    )
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*plain factory: say which contract*"])


class _NoRead(RingBuffer):
    read = None  # type: ignore[assignment]


FALSE_CLAIM = Implementation(
    "buffer", _NoRead, name="tests.NoRead", capabilities={"read", "checkpoint"}
)


def test_a_capability_without_its_methods_is_a_declaration_error() -> None:
    from posttrain.contracts import DeclarationError

    with pytest.raises(
        DeclarationError, match=r"capability 'read' declared, but _NoRead has no read\(\)"
    ):
        check("buffer", FALSE_CLAIM)


def test_the_plugin_says_so_before_running(pytester: pytest.Pytester) -> None:
    res = pytester.runpytest_inprocess(
        "--conformance-impl=tests.conformance.test_kit_mechanics:FALSE_CLAIM"
    )
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*capability 'read' declared, but _NoRead has no read()*"])


def test_markdown_reports_escape_what_the_implementation_wrote() -> None:
    from posttrain.conformance.matrix import render_markdown
    from posttrain.conformance.outcome import Report, Result

    evil = "x|y <script>alert(1)</script> [a](javascript:b)"
    row = Result("BUF-013", "MUST", "empty sample raises", Status.FAIL, f"BUF-013: {evil}")
    rep = Report(run={"implementation": evil, "contract": "buffer", "target": evil}, results=[row])
    for md in (rep.to_markdown(), render_markdown({evil: rep})):
        assert "<script>" not in md
        assert "[a](javascript" not in md
        assert "x\\|y \\<script\\>" in md
    (line,) = [ln for ln in rep.to_markdown().splitlines() if ln.startswith("| BUF-013")]
    assert line.count("|") - line.count("\\|") == 6  # five cells, whatever the message holds
