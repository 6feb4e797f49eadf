"""The TRL callback in two processes (accelerate on gloo, CPU): each process sees half of the
generation, TRL gathers the rewards and reduces its per-micro-batch means across processes,
the callback all-reduces its accumulator. Rank 0's logged catalogue values must equal one
process's over the whole batch (the same fixed completions, reference and perturbation as
tests/adapters/trl/test_callback.py)."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.testing import tiny_causal_lm
from tests.adapters.trl.test_callback import _run


def _rank(rank: int, port: int, tmp: str, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # two processes on the test machine's cores
    try:
        sink, _, _ = _run(Path(tmp), ga=1, per_device=2)
        queue.put((rank, sink.points, sink.hist))
    except BaseException as e:
        queue.put((rank, repr(e), None))
        raise


def test_two_processes_log_the_values_of_one_process_over_the_whole_batch(
    tmp_path: Path,
) -> None:
    tiny_causal_lm().save_pretrained(tmp_path / "policy")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), queue)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            rank, points, hist = queue.get(timeout=180)
            assert hist is not None, f"rank {rank} failed: {points}"
            got[rank] = (points, hist)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:  # a failed rank leaves its peer blocked in a collective
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    one, _, _ = _run(tmp_path, ga=1)
    (p0, h0), (p1, _h1) = got[0], got[1]
    assert p0 == p1  # every rank logs the reduced values
    shared = sorted(set(one.points) & set(p0))
    differ = {
        (name, step): (one.points[name][step], p0[name].get(step))
        for name in shared
        for step in one.points[name]
        if not math.isclose(
            one.points[name][step], p0[name].get(step, math.nan), rel_tol=1e-5, abs_tol=1e-6
        )
    }
    assert not differ, sorted(differ.items())[:10]
    worst = max(
        abs(one.points[n][k] - p0[n][k]) / max(abs(one.points[n][k]), 1e-12)
        for n in shared
        for k in one.points[n]
    )
    print(f"{len(shared)} names at steps 1-2 agree; largest relative difference {worst:.1e}")
    assert len(shared) >= 25, shared
    for name, by_step in one.hist.items():
        assert sorted(h0[name][1]) == sorted(by_step[1]), name
