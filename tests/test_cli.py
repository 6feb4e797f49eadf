"""The ``posttrain`` command line: each subcommand, its exit status and its usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from tests.mutants import buffers

ROOT = Path(__file__).resolve().parent.parent
BROKEN = buffers.MUTANTS["BUF-001"]
"""Returns a list from extend: fails BUF-001, and everything after it is blocked (fast)."""


def test_check_exits_0_on_a_conforming_implementation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "buffer", "reference-buffer"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("posttrain.RingBuffer (reference-buffer) against buffer v1.")
    assert out.rstrip().endswith("verdict: conforms")


def test_check_exits_1_and_prints_each_failure_with_its_repro(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "buffer", "tests.test_cli:BROKEN"]) == 1
    out = capsys.readouterr().out
    assert "  BUF-001 MUST FAIL (must): BUF-001: extend #1" in out
    assert "  BUF-002 MUST FAIL (blocked): BUF-002: blocked by BUF-001" in out
    assert "--conformance-impl=tests.test_cli:BROKEN" in out
    assert out.rstrip().endswith("verdict: does not conform")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["check", "bufer", "reference-buffer"],
            "posttrain check: error: unknown contract 'bufer'; valid: buffer, rollout,",
        ),
        (
            ["check", "buffer", "no-such-impl"],
            "error: unknown implementation 'no-such-impl'; implementations of 'buffer': "
            "ray-served-reference-buffer, reference-buffer,",
        ),
        (
            ["check", "loss", "reference-buffer"],
            "error: 'reference-buffer' implements 'buffer', not 'loss'; implementations of 'loss':",
        ),
        (
            ["report", "--contract", "bufer"],
            "posttrain report: error: unknown contract 'bufer'; valid: buffer,",
        ),
        (
            ["report", "--contract", "buffer", "--impl", "nothing*"],
            "error: no implementation of contract 'buffer' matches 'nothing*'",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_unknown_names_are_usage_errors_that_list_the_valid_ones(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    if "valid" in expected or "implementations of" in expected:
        # At most ten names, then a count.
        listed = err.split(": ")[-1]
        assert listed.count(",") <= 10


def test_report_writes_the_page_and_json_of_the_selected_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["report", "--contract", "buffer", "--impl", "reference*", "--out", str(tmp_path)])
        == 0
    )
    data = json.loads((tmp_path / "conformance.json").read_text())
    assert [r["run"]["target"] for r in data["reports"]] == ["reference-buffer"]
    page = (tmp_path / "conformance.html").read_text()
    assert "reference-buffer" in page
    assert "conforms" in page
    assert (tmp_path / "conformance.md").is_file()
    assert "wrote " in capsys.readouterr().out


def test_list_names_contracts_with_versions_and_implementations_with_frameworks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "contracts:"
    assert any(line.startswith("  buffer v1.") for line in lines)
    rows = {
        line.split()[0]: line.split()[1:]
        for line in lines
        if line.startswith("  ") and " v" not in line
    }
    assert rows["reference-buffer"] == ["buffer", "posttrain"]
    assert rows["torchrl-raw-lazy-tensor"] == ["buffer", "torchrl"]
    assert rows["trl-grpo-rollout"] == ["rollout", "trl"]
    assert rows["nemo-rl-loss-token-mean"] == ["loss", "nemo_rl"]


def test_specs_check_passes_on_the_committed_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["specs", "--check"]) == 0


def test_plot_passes_its_arguments_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from posttrain.reference_impls import JsonlSink

    sink = JsonlSink(str(tmp_path))
    sink.log_scalar("loss/total", 1.0, step=1)
    sink.close()
    png = tmp_path / "dash.png"
    assert main(["plot", str(tmp_path), "--out", str(png)]) == 0
    assert png.is_file()
    assert capsys.readouterr().out.strip() == str(png)


def test_the_console_script_and_python_m_both_run_the_command() -> None:
    script = Path(sys.executable).parent / "posttrain"
    assert script.is_file(), f"expected the console script at {script} (pip install -e .)"
    done = subprocess.run(
        [str(script), "check", "buffer", "no-such-impl"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 2
    assert "unknown implementation 'no-such-impl'" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0
    assert "check" in done.stdout
    assert "report" in done.stdout
