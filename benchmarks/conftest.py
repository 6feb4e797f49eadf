"""Benchmarks print ratios measured in one run: every throughput against memcpy of the same bytes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Row:
    """One measurement: median seconds per call of ``op`` on ``impl`` at ``shape``."""

    op: str
    impl: str
    shape: str
    seconds: float
    nbytes: int
    items: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


ROWS: list[Row] = []
SUITE_TIMES: dict[str, float] = {}
PAIRED: dict[str, float] = {}
SPREAD: dict[str, tuple[float, float]] = {}  # lowest and highest of a PAIRED figure's repeats
REMOTE: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="cpu or cuda")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    d = str(request.config.getoption("device"))
    if d.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("--device cuda but no CUDA device")
    return d


def synced(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn``, then a wait for ``device`` to finish, so a timer sees the work and not its launch.

    CUDA runs kernels asynchronously: timed without the wait, a 64 MiB copy "takes" the few
    microseconds of its launch. On the CPU ``fn`` is returned as it is.
    """
    if not device.startswith("cuda"):
        return fn
    import torch

    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return out

    return call


def torchrl_missing() -> str:
    """Why TorchRL cannot be imported here ("" when it can): a device image may lack it."""
    try:
        import torchrl.data  # noqa: F401
    except Exception as e:  # a wheel built for another torch fails in several ways
        return f"torchrl not importable here: {type(e).__name__}: {e}"
    return ""


def block_medians(
    groups: dict[str, Callable[[], Any]], rounds: int, blocks: int = 5
) -> dict[str, float]:
    """Median seconds per call of each operation, run ``rounds`` times in each of ``blocks``
    blocks that alternate between the operations (so drift on a shared machine hits all)."""
    times: dict[str, list[float]] = {k: [] for k in groups}
    for _ in range(blocks):
        for name, fn in groups.items():
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def record(op: str, impl: str, shape: str, seconds: float, nbytes: int, items: int) -> None:
    """Remember one measurement (median seconds per call)."""
    ROWS.append(Row(op, impl, shape, seconds, nbytes, items))


def _find(op: str, impl: str, shape: str) -> Row | None:
    return next((r for r in ROWS if (r.op, r.impl, r.shape) == (op, impl, shape)), None)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    tr = terminalreporter
    memcpy = _find("memcpy", "torch.Tensor.copy_", "64 MiB")
    if ROWS:
        base = memcpy.gbps if memcpy else None
        tr.write_sep("=", "median throughput; x memcpy = ratio to a 64 MiB copy in this run")
        tr.write_line(
            f"{'op':<9}{'implementation':<40}{'shape':<22}{'GB/s':>8}{'items/s':>12}{'x memcpy':>10}"
        )
        for r in ROWS:
            ratio = f"{r.gbps / base:10.2f}" if base else "       n/a"
            tr.write_line(
                f"{r.op:<9}{r.impl:<40}{r.shape:<22}{r.gbps:8.2f}{r.items / r.seconds:12.0f}{ratio}"
            )
        tr.write_sep("-", "derived ratios (same run)")
        for shape in dict.fromkeys(r.shape for r in ROWS):
            _derived(tr, shape)
    if PAIRED:
        tr.write_sep(
            "-", "headline ratios, B=64, T=512, measured interleaved (benchmarks/test_paired.py)"
        )
        for name, v in PAIRED.items():
            lo_hi = SPREAD.get(name)
            spread = f"   ({lo_hi[0]:.3f} to {lo_hi[1]:.3f})" if lo_hi else ""
            tr.write_line(f"{name:<60}{v:8.3f}{spread}")
    if REMOTE:
        tr.write_sep("-", "across processes on a local Ray cluster (benchmarks/test_remote.py)")
        for name, v in REMOTE.items():
            tr.write_line(f"{name:<72}{v:10.3f}")
    if SUITE_TIMES:
        tr.write_sep("-", "conformance suite wall time per implementation (one run each)")
        for name, s in sorted(SUITE_TIMES.items(), key=lambda kv: -kv[1]):
            tr.write_line(f"{name:<52}{s:8.2f} s")


def _derived(tr: Any, shape: str) -> None:
    ring = _find("extend", "posttrain.RingBuffer", shape)
    raw = _find("extend", "torchrl LazyTensorStorage", shape)
    for what in ("validate", "schema check"):
        v = _find(what, "LLM layout v1" if what == "validate" else "ItemSchema", shape)
        if v and ring:
            tr.write_line(f"{shape:<22}{what} / RingBuffer extend: {v.seconds / ring.seconds:.3f}")
        if v and raw:
            tr.write_line(f"{shape:<22}{what} / TorchRL extend:    {v.seconds / raw.seconds:.3f}")
    for op in ("extend", "sample"):
        for storage in ("LazyTensorStorage", "LazyStackStorage"):
            a = _find(op, f"torchrl {storage} + adapter", shape)
            b = _find(op, f"torchrl {storage}", shape)
            if a and b:
                tr.write_line(
                    f"{shape:<22}adapter / raw TorchRL {storage} {op} time: {a.seconds / b.seconds:.3f}"
                )
        ring_op = _find(op, "posttrain.RingBuffer", shape)
        raw_op = _find(op, "torchrl LazyTensorStorage", shape)
        if ring_op and raw_op:
            tr.write_line(
                f"{shape:<22}RingBuffer / TorchRL LazyTensorStorage {op} throughput: "
                f"{raw_op.seconds / ring_op.seconds:.2f}x"
            )
