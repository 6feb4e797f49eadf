"""Benchmarks print ratios measured in one run: every throughput against memcpy of the same bytes."""

from __future__ import annotations

from typing import Any

import pytest

RESULTS: dict[str, dict[str, float]] = {}


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


def record(name: str, seconds: float, nbytes: int, items: int) -> None:
    """Remember one measurement (median seconds per call)."""
    RESULTS[name] = {"s": seconds, "GBps": nbytes / seconds / 1e9, "items_per_s": items / seconds}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    base = RESULTS.get("memcpy", {}).get("GBps")
    tr.write_sep("=", "throughput (median), ratio to memcpy of the same bytes in this run")
    for name, r in RESULTS.items():
        ratio = f"{r['GBps'] / base:6.2f}" if base else "   n/a"
        tr.write_line(
            f"{name:<48} {r['GBps']:8.2f} GB/s {r['items_per_s']:12.0f} items/s   x memcpy {ratio}"
        )
    v, e = RESULTS.get("validate (metadata) LLM layout"), RESULTS.get("extend posttrain.RingBuffer")
    if v and e:
        tr.write_line(
            f"validation cost / RingBuffer extend of the same batch: {v['s'] / e['s']:.3f}"
        )
    for op in ("extend", "sample"):
        wrapped = RESULTS.get(f"{op} torchrl LazyTensorStorage + adapter")
        raw = RESULTS.get(f"{op} torchrl LazyTensorStorage")
        if wrapped and raw:
            tr.write_line(
                f"adapter {op} time / raw TorchRL {op} time: {wrapped['s'] / raw['s']:.3f}"
            )
