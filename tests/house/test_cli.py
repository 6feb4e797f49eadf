"""The ``posttrain`` command line: each subcommand, its exit status and its usage errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from tests.mutants import buffers
from tests.paths import ROOT

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
    assert main(["check", "buffer", "tests.house.test_cli:BROKEN"]) == 1
    out = capsys.readouterr().out
    assert "  BUF-001 MUST FAIL (must): BUF-001: extend #1" in out
    assert "  BUF-002 MUST FAIL (blocked): BUF-002: blocked by BUF-001" in out
    assert "--conformance-impl=tests.house.test_cli:BROKEN" in out
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


HEAVY = ("torch", "tensordict", "torchrl", "ray", "transformers", "trl", "numpy")
"""Top-level packages that take seconds to import: none of them before a check runs."""

SCRIPT = Path(sys.executable).parent / "posttrain"


def _heavy_imported_by(code: str) -> list[str]:
    probe = (
        f"import sys\n{code}\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')))


@pytest.mark.parametrize(
    "code",
    [
        "from posttrain.cli import main; main(['list'])",
        "from posttrain.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "from posttrain.cli import main\ntry:\n    main(['check', 'bufer', 'x'])\n"
        "except SystemExit:\n    pass",
        "from posttrain.cli import main\ntry:\n    main(['check', 'buffer', 'no-such-impl'])\n"
        "except SystemExit:\n    pass",
        "from posttrain.cli import main\ntry:\n    main(['check', 'loss', 'reference-buffer'])\n"
        "except SystemExit:\n    pass",
        "import posttrain.conformance",
        *(
            f"from posttrain.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass"
            for args in (
                ["report", "--help"],
                ["specs", "--help"],
                ["plot", "--help"],
                ["report", "--rows", "bogus"],
            )
        ),
    ],
    ids=[
        "list",
        "help",
        "unknown-contract",
        "unknown-impl",
        "wrong-contract",
        "import-kit",
        "report-help",
        "specs-help",
        "plot-help",
        "report-usage-error",
    ],
)
def test_the_command_answers_without_importing_torch_or_a_framework(code: str) -> None:
    assert _heavy_imported_by(code) == []


def test_every_public_name_of_the_kit_is_still_importable() -> None:
    import posttrain.conformance as kit

    for name in kit.__all__:
        assert getattr(kit, name) is not None, name
    from posttrain.conformance import Report, check

    assert callable(check)
    assert Report.__name__ == "Report"
    assert set(kit.__all__) <= set(dir(kit))


def test_list_reads_what_the_registry_holds() -> None:
    """posttrain._listing reads contracts from source and contracts of entry points from an
    index: both must say what importing the registry and loading every entry point says."""
    from posttrain import _listing
    from posttrain._listing_index import CONTRACT_OF
    from posttrain.conformance.matrix import framework_of, implementations
    from posttrain.contracts.registry import CONTRACTS

    assert list(_listing.contracts()) == [(c.id, c.version, c.title) for c in CONTRACTS.values()]
    impls = implementations()
    eps = _listing.entry_points()
    stale = {
        ep.value: (CONTRACT_OF.get(ep.value), impls[name].contract)
        for name, ep in eps.items()
        if ep.value.startswith("posttrain.") and CONTRACT_OF.get(ep.value) != impls[name].contract
    }
    gone = set(CONTRACT_OF) - {ep.value for ep in eps.values()}
    assert (stale, gone) == ({}, set()), (
        f"posttrain/_listing_index.py is out of date ({stale}, {gone}): "
        "run python -m posttrain._listing"
    )
    rows = {r.name: r for r in _listing.implementation_rows()}
    assert {n: (r.contract, r.framework) for n, r in rows.items()} == {
        n: (i.contract, framework_of(n)) for n, i in impls.items()
    }


def test_an_entry_point_the_index_does_not_know_is_loaded() -> None:
    from importlib import metadata

    from posttrain import _listing

    ep = metadata.EntryPoint(
        "mine", "posttrain.reference_impls:RING_BUFFER", _listing.ENTRY_POINT_GROUP
    )
    ep_unknown = metadata.EntryPoint(
        "mine", "tests.house.test_cli:BROKEN", _listing.ENTRY_POINT_GROUP
    )
    assert _listing.contract_of(ep) == "buffer"
    assert _listing.contract_of(ep_unknown) == "buffer"
    assert _listing.framework_of("mine", "tests.house.test_cli:BROKEN") == "tests"


_LOCAL_BUFFER = """
import logging
import sys

from posttrain.reference_impls import RingBuffer

# A library that logs INFO through a handler of its own, as TorchRL and Ray do.
_log = logging.getLogger("chatty_library")
_log.setLevel(logging.INFO)
_log.addHandler(logging.StreamHandler(sys.stdout))
_log.propagate = False


def make_buffer(capacity):
    _log.info("chatty_library: INFO line")
    return RingBuffer(capacity)
"""


def test_check_imports_a_module_from_the_current_folder_and_is_quiet_unless_verbose(
    tmp_path: Path,
) -> None:
    assert SCRIPT.is_file(), f"expected the console script at {SCRIPT} (pip install -e .)"
    (tmp_path / "mybuf.py").write_text(_LOCAL_BUFFER)
    done = subprocess.run(
        [str(SCRIPT), "check", "buffer", "mybuf:make_buffer"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("mybuf:make_buffer against buffer v1.")
    assert done.stdout.rstrip().endswith("verdict: conforms")
    assert "chatty_library" not in done.stdout + done.stderr
    loud = subprocess.run(
        [str(SCRIPT), "-v", "check", "buffer", "mybuf:make_buffer"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert loud.returncode == 0, loud.stdout + loud.stderr
    assert "chatty_library: INFO line" in loud.stdout


def test_quiet_logs_hides_info_and_restores_everything() -> None:
    import logging
    import os

    from posttrain.cli import quiet_logs

    before = (logging.root.manager.disable, os.environ.get("POSTTRAIN_QUIET"))
    with quiet_logs(verbose=False):
        assert not logging.getLogger("ray").isEnabledFor(logging.INFO)
        assert logging.getLogger("ray").isEnabledFor(logging.WARNING)
        assert os.environ["POSTTRAIN_QUIET"] == "1"
        assert os.environ["RL_LOGGING_LEVEL"] in ("WARNING", os.environ.get("RL_LOGGING_LEVEL"))
    assert (logging.root.manager.disable, os.environ.get("POSTTRAIN_QUIET")) == before


@pytest.mark.parametrize("command", [[], ["check"], ["list"], ["report"], ["specs"], ["plot"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([*command, "--help"])
    except SystemExit as e:
        code = int(e.code or 0)
    assert code == 0
    out = capsys.readouterr().out
    assert "usage: posttrain" in out
    for markup in ("``", "::", ":func:", ":class:", ":mod:", ":data:"):
        assert markup not in out, f"{markup!r} in the help of {command}:\n{out}"
    assert "-v, --verbose" in out


def test_messages_reach_every_report_format_without_terminal_escapes() -> None:
    import torch
    from tensordict import TensorDictBase

    from posttrain.conformance.matrix import render_html, render_markdown
    from posttrain.conformance.outcome import reports_json
    from posttrain.conformance.runner import run
    from posttrain.contracts import Implementation
    from posttrain.reference_impls import RingBuffer

    class Coloured(RingBuffer):
        def extend(self, data: TensorDictBase, /) -> torch.Tensor:
            raise ValueError("\x1b[31mno room\x1b[0m for \x1b]8;;http://x\x07this\x1b]8;;\x07")

    rep = run(Implementation("buffer", Coloured, name="coloured"))
    messages = [r.message for r in rep.results if r.message]
    assert any("no room for this" in m for m in messages), messages
    for text in (
        *messages,
        render_markdown({"coloured": rep}),
        render_html({"coloured": rep}),
        reports_json([rep]),
    ):
        assert "\x1b" not in text
        assert "[31m" not in text
        assert "\\u001b" not in text


def test_a_ray_task_error_keeps_the_remote_type_and_text() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from posttrain.conformance.runner import clean_message, remote_cause

    cause = KeyError("no key ('tokens', 'full')")
    try:
        raise cause
    except KeyError:
        import traceback

        trace = traceback.format_exc()
    wrapped = ray_exceptions.RayTaskError(
        "BufferHost.call", trace, cause, proctitle="ray::BufferHost.call"
    ).as_instanceof_cause()
    assert remote_cause(wrapped) is cause
    message = clean_message(f"raised {type(wrapped).__name__}: {wrapped}")
    assert message.startswith("raised KeyError: \"no key ('tokens', 'full')\"")
    assert "BufferHost.call()" in message
    assert "\x1b" not in message
    assert "RayTaskError" not in message
    assert "File " not in message


def test_a_process_the_command_starts_is_quiet_as_its_parent() -> None:
    """A report's workers are spawned: they import posttrain.cli again and read the setting
    from their environment."""
    import os

    probe = (
        "import logging, posttrain.cli\n"
        "logging.getLogger('ray').setLevel(logging.INFO)  # as Ray does when imported\n"
        "print(logging.getLogger('ray').isEnabledFor(logging.INFO), "
        "logging.getLogger('ray').isEnabledFor(logging.WARNING))"
    )
    for quiet, expected in (("1", "False True"), ("0", "True True")):
        done = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            env={**os.environ, "POSTTRAIN_QUIET": quiet},
            timeout=60,
        )
        assert done.stdout.strip() == expected, done.stderr


def test_a_module_missing_from_the_search_path_says_where_it_was_looked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from posttrain.conformance.target import TargetError, resolve

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        TargetError,
        match=r"'no_such_mod_q'.*\((searched .* and the installed|the current folder is not)",
    ):
        resolve("no_such_mod_q:make", "buffer")


def test_a_reader_that_leaves_early_gets_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    class GoneReader(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", GoneReader())
    assert main(["list"]) == 1


def test_help_paragraphs_are_wrapped_again_after_the_markup_goes() -> None:
    from posttrain.cli import _refill, plain

    text = "usage: x\n\nA ``b``\nc ``d`` e.\n\noptions:\n  -h  help"
    assert _refill(plain(text)) == "usage: x\n\nA b c d e.\n\noptions:\n  -h  help"


def test_a_ray_task_error_cut_short_by_a_check_keeps_its_type_and_drops_the_process_details() -> (
    None
):
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from posttrain.conformance.runner import clean_message

    wrapped = ray_exceptions.RayTaskError(
        "BufferHost.call", "Traceback ...\nKeyError: 'k'", KeyError("k"), proctitle="ray::H.call"
    ).as_instanceof_cause()
    shown = f"\x1b[36m{str(wrapped)[:45]}"
    message = clean_message(f"raised {type(wrapped).__name__}: {shown}; len went from 6 to 8")
    assert message == (
        "raised KeyError: ray::H.call() (the remote error's text was cut off); len went from 6 to 8"
    )


@pytest.mark.parametrize("argv", [["-v", "report"], ["report", "-v"], ["report", "--verbose"]])
def test_verbose_is_taken_before_or_after_a_pass_through_command(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--contract", "bufer"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown contract 'bufer'" in err
    assert "unrecognized arguments" not in err
