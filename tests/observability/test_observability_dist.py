"""Two real gloo ranks, each with half of a batch, report the catalogue values one process
computes over the whole batch (``Accumulator.all_reduce``)."""

from __future__ import annotations

import math
import socket
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.observability import Accumulator, loss_metrics, policy_metrics, rollout_metrics
from tests.observability.test_observability_numbers import LEARNER, TEMP, _pad, _rows, _td

CLIP = (0.2, 0.28)


def _metrics(rows: list[dict[str, Any]], acc: Accumulator, share: float) -> None:
    td = _td(rows, ragged=False)
    rollout_metrics(
        td,
        acc,
        learner_version=LEARNER,
        truncated=torch.tensor([r["trunc"] for r in rows]),
        reward_fns={"fmt": torch.tensor([r["fn"] for r in rows])},
    )
    policy_metrics(
        td,
        _pad(rows, "logits", 0.0),
        acc,
        clip=CLIP,
        old_log_probs=_pad(rows, "old", math.nan),
        temperature=TEMP,
    )
    # A loss normalized by the global batch's counts: each rank's term is its share.
    loss_metrics({"loss_objective": torch.tensor(share)}, acc)
    acc.add("time/rollout_s", 2.0)  # both ranks generate for 2 s at once
    acc.add("perf/gen_tokens_per_s", 1000, 2.0)
    acc.add("perf/gen_tokens_per_s_per_rank", 1000, 2.0)
    acc.add("optim/lr", 1e-3)


def _rank(rank: int, port: int, queue: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        rows = _rows("padded")[2 * rank : 2 * rank + 2]  # groups 0 and 1 stay whole
        acc = Accumulator()
        _metrics(rows, acc, share=[0.25, 0.5][rank])
        acc.all_reduce()
        queue.put((rank, acc.values()))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_report_the_values_of_one_rank_over_the_whole_batch() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        # A rank that failed leaves its peer blocked in a collective: end both.
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    one = Accumulator()
    _metrics(_rows("padded"), one, share=0.75)
    want = one.values()
    want["time/rollout_s"] = 2.0  # the slowest rank's wall time, not 4 s
    want["perf/gen_tokens_per_s"] = 1000.0  # 2,000 tokens in 2 s: the job's rate
    want["perf/gen_tokens_per_s_per_rank"] = 500.0  # one rank's: 2,000 tokens in 4 rank-seconds
    for rank, values in got.items():
        assert sorted(values) == sorted(want)
        bad = {
            k: (values[k], want[k])
            for k in want
            if not math.isclose(values[k], want[k], rel_tol=1e-12, abs_tol=1e-12)
        }
        assert not bad, (rank, bad)
    assert len(want) == 40  # 34 rollout, policy and staleness metrics; loss, time, 2 rates, lr


def test_rank_states_travel_as_json_not_pickle() -> None:
    from posttrain.observability.reduce import _decode_state, _encode_state

    acc = Accumulator()
    acc.add("optim/lr", math.nan)
    acc.add("time/rollout_s", math.inf)
    acc.add("perf/gen_tokens_per_s", 1000, 3.0)
    state = acc.state()
    back = _decode_state(_encode_state(state))
    for part, vals in state.items():  # NaN, inf and 1000/3 come back bit for bit
        assert repr(sorted(back[part].items())) == repr(sorted(vals.items())), part
    try:
        _decode_state(b'{"num": "x"}')
    except ValueError:
        pass
    else:
        raise AssertionError("decoded a malformed state without complaint")
