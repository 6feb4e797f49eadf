"""How fast the ``posttrain`` command answers, each run a fresh process of the installed script.

- ``posttrain --help`` and ``posttrain list``: nothing heavy is imported (no torch);
- time to first verdict: ``posttrain check buffer mybuf:make_buffer`` run from the folder that
  holds ``mybuf.py`` (a small local buffer, the reference ``RingBuffer``), from the start of
  the process to its verdict line: Python start-up, torch, the suite and the run itself.

Each figure is the median wall time of a few runs (the lowest and highest follow in brackets),
then the CPU time the process used: on a busy machine the wall time grows with the load (printed
too) while the CPU time stays near what a quiet machine's wall time would be.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(sys.executable).parent / "posttrain"

_MYBUF = """
from posttrain.reference_impls import RingBuffer


def make_buffer(capacity):
    return RingBuffer(capacity)
"""


def _wall(
    argv: list[str], cwd: Path, until: str | None = None, code: int = 0
) -> tuple[float, float]:
    """Wall seconds from starting ``posttrain argv`` to the first output line holding ``until``
    (to its exit when ``until`` is None), and the CPU seconds the process used in all; the exit
    status must be ``code``."""
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: it never fills and blocks
        start = time.perf_counter()
        proc = subprocess.Popen(
            [str(SCRIPT), *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True
        )
        assert proc.stdout is not None
        seen = None
        for line in proc.stdout:
            if until is not None and seen is None and until in line:
                seen = time.perf_counter() - start
        _, status, usage = os.wait4(proc.pid, 0)
        took = time.perf_counter() - start if until is None else seen
        err.seek(0)
        assert os.waitstatus_to_exitcode(status) == code, err.read()
    assert took is not None, f"no line with {until!r} from posttrain {' '.join(argv)}"
    return took, usage.ru_utime + usage.ru_stime


def _measure(
    benchmark: Any,
    capsys: pytest.CaptureFixture[str],
    what: str,
    argv: list[str],
    cwd: Path,
    rounds: int,
    **kw: Any,
) -> None:
    runs: list[tuple[float, float]] = []
    benchmark.pedantic(lambda: runs.append(_wall(argv, cwd, **kw)), rounds=rounds, iterations=1)
    wall = sorted(w for w, _ in runs)
    cpu = statistics.median(c for _, c in runs)
    with capsys.disabled():  # the figure shows under -q too
        print(
            f"\n{what:<64}{statistics.median(wall):7.2f} s wall ({wall[0]:.2f} to {wall[-1]:.2f}),"
            f" {cpu:.2f} s CPU; {rounds} runs, load average {os.getloadavg()[0]:.1f}"
        )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SCRIPT.is_file():
        pytest.skip(f"no console script at {SCRIPT} (pip install -e .)")
    d = tmp_path_factory.mktemp("cli")
    (d / "mybuf.py").write_text(_MYBUF)
    return d


def test_help_wall_time(benchmark: Any, capsys: pytest.CaptureFixture[str], folder: Path) -> None:
    _measure(benchmark, capsys, "posttrain --help", ["--help"], folder, rounds=5)


def test_list_wall_time(benchmark: Any, capsys: pytest.CaptureFixture[str], folder: Path) -> None:
    _measure(benchmark, capsys, "posttrain list", ["list"], folder, rounds=5)


def test_usage_error_wall_time(
    benchmark: Any, capsys: pytest.CaptureFixture[str], folder: Path
) -> None:
    argv = ["check", "bufer", "mybuf:make_buffer"]
    _measure(
        benchmark, capsys, "posttrain check bufer ... (a usage error)", argv, folder, 5, code=2
    )


def test_time_to_first_verdict(
    benchmark: Any, capsys: pytest.CaptureFixture[str], folder: Path
) -> None:
    _measure(
        benchmark,
        capsys,
        "time to first verdict: posttrain check buffer mybuf:make_buffer",
        ["check", "buffer", "mybuf:make_buffer"],
        folder,
        rounds=3,
        until="verdict:",
    )
