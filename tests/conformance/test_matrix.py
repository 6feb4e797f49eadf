"""`make report`: a row failing other than its declared known failures fails the report."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from posttrain.adapters.torchrl import implementations as trl_impls
from posttrain.conformance import Status
from posttrain.conformance import matrix as matrix_mod
from posttrain.conformance.html_report import verdict_of
from posttrain.conformance.outcome import Report, Result, md_cell, reports_json, retry_note
from posttrain.conformance.runner import DEFAULT_TIMEOUT_S
from posttrain.conformance.target import TargetError, discover
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import make_ring_buffer

IDS = ["BUF-009", "BUF-010", "BUF-013", "BUF-016", "BUF-018"]


def _report(known: list[str], fails: dict[str, str]) -> Report:
    rows = [
        Result(rid, "MUST", "t", Status.FAIL, f"{rid}: {fails[rid]}")
        if rid in fails
        else Result(rid, "MUST", "t", Status.PASS)
        for rid in IDS
    ]
    return Report(run={"contract": "buffer", "known_failures": known}, results=rows)


def test_declared_failures_are_expected_and_anything_else_is_not() -> None:
    as_declared = _report(["BUF-009"], {"BUF-009": "accepted", "BUF-016": "blocked by BUF-009"})
    assert as_declared.failed_ids() == {"BUF-009"}  # a blocked row is not its own failure
    assert as_declared.surprises() == []
    new = _report(["BUF-009"], {"BUF-009": "x", "BUF-010": "y"})
    fixed_upstream = _report(["BUF-009", "BUF-018"], {"BUF-009": "x"})
    assert new.surprises() == ["BUF-010 failed (not a declared known failure)"]
    assert fixed_upstream.surprises() == ["BUF-018 declared a known failure but did not fail"]
    reports = {"raw": as_declared, "new": new, "fixed": fixed_upstream, "ok": _report([], {})}
    assert matrix_mod.exit_status({"raw": as_declared, "ok": reports["ok"]}) == 0
    assert matrix_mod.exit_status(reports) == 1
    md = matrix_mod.render_markdown(reports)
    assert "| does not conform (as declared) |" in md
    assert "| unexpected |" in md
    assert "- **fixed** BUF-018 declared a known failure but did not fail" in md


def test_main_returns_1_on_an_unexpected_row(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wrong = Implementation("buffer", make_ring_buffer, name="ring", known_failures={"BUF-013"})
    monkeypatch.setattr(matrix_mod, "discover", lambda: {"ring": _EntryPoint(wrong)})
    assert matrix_mod.main(["--out", str(tmp_path)]) == 1
    assert (
        "BUF-013 declared a known failure but did not fail"
        in (tmp_path / "conformance.md").read_text()
    )


class _EntryPoint:
    def __init__(self, obj: Implementation, value: str = "test:obj") -> None:
        self.obj, self.value = obj, value

    def load(self) -> Implementation:
        return self.obj


def test_a_declared_failure_that_did_not_run_says_why() -> None:
    blocked = _report(["BUF-016"], {"BUF-009": "x", "BUF-016": "blocked by BUF-009"})
    assert blocked.surprises() == [
        "BUF-009 failed (not a declared known failure)",
        "BUF-016 declared a known failure but did not run (blocked)",
    ]


def test_known_failures_name_requirements_of_the_contract() -> None:
    with pytest.raises(TypeError, match="found the string 'BUF-009'"):
        Implementation("buffer", make_ring_buffer, known_failures="BUF-009")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"buffer v.* has no requirement 'LOSS-001'"):
        Implementation("buffer", make_ring_buffer, known_failures={"LOSS-001"})


def test_only_raw_upstream_rows_and_should_failures_declare_known_failures() -> None:
    declared = {n: ep.load().known_failures for n, ep in discover().items()}
    with_failures = {n for n, k in declared.items() if k}
    assert with_failures == {n for n in declared if "-raw-" in n} | {
        "torchrl-wandb-logger",
        "torchrl-csv-logger",  # MET-007, a SHOULD
        "torchrl-tensorboard-logger",  # MET-007, a SHOULD
        "mlflow-sink",
        # BUF-018 (MUST): the served storage's state arrives with nested names joined by '.'
        "torchrl-adapted-ray-lazy-tensor",
        # LOSS-003 (MUST): Clip-Cov zeroes drawn tokens' terms by design (its algorithm)
        "verl-adapted-clip-cov-token-mean",
    }
    assert "BUF-018" in trl_impls.RAW_LAZY_STACK.known_failures


def test_every_declared_torchrl_failure_has_a_published_repro() -> None:
    # The declarations are the tests' expectations; this ties them to an independent source:
    # the deviations published with repros in docs/reports (posttrain.adapters.torchrl.deviations).
    from posttrain.adapters.torchrl import deviations as dev

    repros = [
        d
        for group in (
            dev.DEVIATIONS,
            dev.LOSS_DEVIATIONS,
            dev.ROLLOUT_DEVIATIONS,
            dev.WEIGHT_SYNC_DEVIATIONS,
            dev.GENERATION_DEVIATIONS,
            dev.RAY_DEVIATIONS,
            dev.LOGGER_DEVIATIONS,
        )
        for d in group
    ]
    declared = {
        r
        for n, ep in discover().items()
        if n.startswith("torchrl-")
        for r in ep.load().known_failures
    }
    assert declared <= {r for d in repros for r in d.requirements}
    # A repro whose requirements a declared failure blocks in a full run still belongs to the row.
    assert [d.title for d in repros if not {*d.requirements, *d.blocked_by} & declared] == []


def test_markdown_and_html_say_the_same_for_each_cell_and_verdict() -> None:
    # A blocked check did not run: "blocked" in every format, never "FAIL (MUST)".
    rep = _report(["BUF-009"], {"BUF-009": "accepted", "BUF-016": "blocked by BUF-009"})
    md = matrix_mod.render_markdown({"raw": rep})
    row = next(line for line in md.splitlines() if line.startswith("| BUF-016 "))
    assert row == "| BUF-016 t | blocked |"
    assert "| BUF-009 t | FAIL |" in md
    assert "FAIL (MUST)" not in md
    assert "- **raw** BUF-016" not in md  # not its own failure: the foundation says it
    page = matrix_mod.render_html({"raw": rep})
    assert "class='k-blocked' title='BUF-016: blocked by BUF-009'>blocked</td>" in page
    assert verdict_of(rep) == "does not conform (as declared)"
    assert f"| {verdict_of(rep)} |" in md


DISTRIBUTED_ROWS = {
    "ray-served-reference-buffer",
    "torchrl-raw-ray-lazy-tensor",
    "torchrl-adapted-ray-lazy-tensor",
    "torchrl-raw-ray-weight-sync",
    "torchrl-adapted-ray-weight-sync",
    "torchrl-raw-dist-weight-sync",
    "torchrl-adapted-dist-weight-sync",
}


def test_the_rows_that_start_ray_or_torch_distributed_are_the_distributed_ones() -> None:
    every = matrix_mod.implementations()
    assert {n for n, i in every.items() if matrix_mod.is_distributed(i)} == DISTRIBUTED_ROWS
    assert set(matrix_mod.select(rows="distributed")) == DISTRIBUTED_ROWS
    assert set(matrix_mod.select(rows="in-process")) == set(every) - DISTRIBUTED_ROWS
    with pytest.raises(TargetError, match="no distributed implementation of contract 'loss'"):
        matrix_mod.select("loss", rows="distributed")
    with pytest.raises(ValueError, match="rows: expected one of all, in-process, distributed"):
        matrix_mod.select(rows="local")


def test_a_distributed_row_is_retried_once_and_the_report_says_so() -> None:
    outcomes = iter([{"BUF-013": "no error"}, {}, {"BUF-013": "x"}, {"BUF-013": "y"}, {}])
    calls: list[int] = []

    def attempt() -> Report:
        calls.append(1)
        return _report([], next(outcomes))

    flaky = matrix_mod.run_with_retry(attempt)
    assert len(calls) == 2
    assert flaky.surprises() == []
    assert [a["verdict"] for a in flaky.run["attempts"]] == ["does not conform", "conforms"]
    note = "retried: attempt 1 of 2 was does not conform (BUF-013 failed (not a declared known failure))"
    assert retry_note(flaky) == note
    md = matrix_mod.render_markdown({"flaky": flaky})
    assert f"| conforms; {md_cell(note)} |" in md
    page = matrix_mod.render_html({"flaky": flaky})
    assert "<span class='retry'" in page
    assert html.escape(note, quote=True) in page
    assert '"attempts": [' in reports_json([flaky])
    # Bounded: a row that fails every time runs MAX_ATTEMPTS times and reports its failure.
    broken = matrix_mod.run_with_retry(attempt)
    assert len(calls) == 2 + matrix_mod.MAX_ATTEMPTS
    assert broken.surprises() == ["BUF-013 failed (not a declared known failure)"]
    assert len(broken.run["attempts"]) == matrix_mod.MAX_ATTEMPTS


def test_distributed_timeouts_grow_with_the_measured_start_up() -> None:
    assert matrix_mod.derived_timeout(0.5) == DEFAULT_TIMEOUT_S
    assert matrix_mod.derived_timeout(30.0) == 30.0 * matrix_mod.TIMEOUT_PER_STARTUP


def test_worker_processes_give_the_reports_one_process_gives() -> None:
    glob = "reference-loss-*"
    serial = matrix_mod.run_all(contract="loss", impl_glob=glob, jobs=1)
    parallel = matrix_mod.run_all(contract="loss", impl_glob=glob, jobs=2)
    assert list(parallel) == list(serial) == sorted(serial)
    assert len(serial) >= 2
    for name, rep in serial.items():
        got = parallel[name]
        assert [(r.id, r.status, r.message) for r in got.results] == [
            (r.id, r.status, r.message) for r in rep.results
        ]
        assert got.run["target"] == name
        assert got.run["duration_s"] > 0


def test_the_in_process_report_names_the_rows_it_leaves_to_report_distributed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ring = Implementation("buffer", make_ring_buffer, name="ring")
    remote = Implementation(
        "buffer", make_ring_buffer, name="remote", capabilities={"remote_writers"}
    )
    monkeypatch.setattr(
        matrix_mod, "discover", lambda: {"ring": _EntryPoint(ring), "remote": _EntryPoint(remote)}
    )
    assert matrix_mod.main(["--out", str(tmp_path), "--rows", "in-process"]) == 0
    md = (tmp_path / "conformance.md").read_text()
    sentence = (
        "1 row that starts Ray or torch.distributed is not here: `make report-distributed` "
        "runs it (remote)."
    )
    assert sentence in md
    assert "| ring |" in md
    assert "| remote |" not in md
    assert html.escape(sentence, quote=True) in (tmp_path / "conformance.html").read_text()
    assert [
        r["run"]["target"]
        for r in json.loads((tmp_path / "conformance.json").read_text())["reports"]
    ] == ["ring"]


def test_previous_durations_order_the_next_run(tmp_path: Path) -> None:
    rep = Report(run={"target": "slow", "duration_s": 9.5}, results=[])
    (tmp_path / "conformance.json").write_text(reports_json([rep]))
    assert matrix_mod.previous_durations(tmp_path) == {"slow": 9.5}
    (tmp_path / "conformance.json").write_text("{not json")
    assert matrix_mod.previous_durations(tmp_path) == {}
