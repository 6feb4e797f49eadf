"""What the loss tests under accumulation and data parallelism share (no tests here).

The batch (answers of 3, 8, 6, 1, 0 and 5 assistant tokens after a 3-token prompt, off
policy, advantages of both signs), the micro-batch splits and rank shards, and the gloo
harness: each rank is a spawned process on loopback that all-reduces the global counts, then
its loss value and flat gradient by sum; rank 0 saves the results for the test to compare.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from posttrain._forkserver import context
from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts
from posttrain.testing import llm_batch

K = LLM_LAYOUT_V1.key
V, PROMPT = 64, 3
ANSWERS = (3, 8, 6, 1, 0, 5)  # assistant tokens per row; row 4 has none
SPLITS = (
    ((0, 1), (2, 3), (4, 5)),  # even
    ((0,), (1, 2, 3, 4, 5)),  # one row, then the rest
    ((3, 0, 5), (4,), (1, 2)),  # shuffled; a micro-batch without any assistant token
)
SHARDS = {2: ((0, 2, 4), (1, 3, 5)), 4: ((0, 5), (1,), (2, 3), (4,))}  # rank 3: no token


def batch(policy: Any) -> TensorDictBase:
    """The rows of ANSWERS, off-policy (ratios around 1, some clipped), advantages of both
    signs; the answers start after a 3-token prompt."""
    b, t = len(ANSWERS), PROMPT + max(ANSWERS) + 1
    td = llm_batch(b, t, vocab_size=V, seed=3)
    pos = torch.arange(t).expand(b, t)
    lengths = torch.tensor(ANSWERS)
    att = pos < PROMPT + lengths[:, None]
    td.set(K("attention_mask"), att)
    asst = (pos >= PROMPT) & att
    td.set(K("assistant_mask"), asst)
    with torch.no_grad():
        logits = policy(input_ids=td.get(K("tokens")), attention_mask=att.long()).logits
    own = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, td.get(K("tokens"))[:, 1:, None])
    own = torch.cat([torch.zeros(b, 1), own[..., 0]], 1)
    g = torch.Generator().manual_seed(5)
    slp = own + 0.3 * torch.randn(b, t, generator=g)
    td.set(K("sample_log_probs"), torch.where(asst, slp, float("nan")))
    td.set(K("ref_log_probs"), torch.where(asst, own - 0.2, float("nan")))
    td.set(K("advantage"), torch.tensor([1.0, -0.5, 0.8, -1.2, 0.7, 0.4]))
    return td


def flat_grad(total: Any, params: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of ``total`` over ``params``, flat in float64 (zeros where none reaches;
    a micro-batch without assistant tokens may give a constant)."""
    grads: tuple[torch.Tensor | None, ...] = (None,) * len(params)
    if isinstance(total, torch.Tensor) and total.requires_grad:
        grads = torch.autograd.grad(total, params, allow_unused=True)
    flat = [
        (g if g is not None else torch.zeros_like(p)).double().flatten()
        for g, p in zip(grads, params, strict=True)
    ]
    return torch.cat(flat)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the largest entry of ``b``."""
    return float((a - b).abs().max() / b.abs().max())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """One process's membership of a gloo group on loopback, one thread, left in finally."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def all_reduced_counts(shard: TensorDictBase) -> GlobalCounts:
    """The global batch's counts: every rank's own, summed over ranks."""
    local = GlobalCounts.of(shard)
    both = torch.tensor([local.tokens, local.sequences], dtype=torch.int64)
    dist.all_reduce(both)
    return GlobalCounts(tokens=int(both[0]), sequences=int(both[1]))


def all_reduced(value: float, grad: torch.Tensor) -> tuple[float, torch.Tensor]:
    """A loss value and its gradient summed over ranks (gradients all-reduce by sum)."""
    pair = torch.cat([torch.tensor([value], dtype=torch.float64), grad])
    dist.all_reduce(pair)
    return float(pair[0]), pair[1:].clone()


def run_ranks(target: Callable[..., None], world: int, out: str, timeout: float) -> None:
    """``target(rank, world, port, out)`` in ``world`` processes; all must exit 0.

    The processes fork from a forkserver that imported torch and the target's module once
    (a fresh interpreter each spent seconds importing them); nothing else is inherited.
    """
    ctx = context(["torch", "torch.distributed", target.__module__])
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert [p.exitcode for p in procs] == [0] * world
