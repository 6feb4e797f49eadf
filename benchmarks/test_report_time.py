"""``make report``'s wall time after the install: the in-process rows of every bundled implementation.

The command ``make report`` runs (``posttrain report --rows in-process``), in a fresh process as
make starts it: spawning the worker processes and their imports are part of the figure. Its
target on 2 cores is 3 minutes (docs/conformance.md); the figure lands in
``benchmarks/results/report-time-cpu-2core.txt``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from posttrain.conformance.matrix import default_jobs

TARGET_S = 180.0
"""The budget of ``make report`` after the install on 2 cores (a figure, not an assertion)."""


def _report(out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "posttrain.cli",
        "report",
        "--rows",
        "in-process",
        "--out",
        str(out),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_make_report_wall_time(benchmark: Any, tmp_path: Path, capsys: Any) -> None:
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = benchmark.pedantic(_report, args=(tmp_path,), rounds=1, iterations=1)
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the command and its workers: on a machine others also load, the wall
    # time grows but this does not (much); over the cores it bounds the idle machine's wall time.
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = json.loads((tmp_path / "conformance.json").read_text())["reports"]
    rows = sorted(((r["run"]["duration_s"], r["run"]["target"]) for r in reports), reverse=True)
    serial_s = sum(d for d, _ in rows)
    benchmark.extra_info.update(wall_s=wall_s, cpu_s=cpu_s, rows=len(rows), serial_s=serial_s)
    with capsys.disabled():
        print(
            f"\nmake report (in-process rows, {default_jobs()} worker processes): {len(rows)} rows "
            f"in {wall_s:.1f} s wall (target {TARGET_S:.0f} s), {cpu_s:.1f} CPU s; the rows' own "
            f"times add up to {serial_s:.1f} s; load average before {load:.1f}; longest: "
            + ", ".join(f"{n} {d:.1f} s" for d, n in rows[:5])
        )
