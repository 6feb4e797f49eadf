"""What the observability hooks cost per step, against work every step already does.

Batch-level hooks (rollout, loss, buffer, timers: everything but the policy's logits) at B=64,
T=512 are timed against the reference buffer's extend + sample of the same batch, the cheapest
thing a step does with it. ``policy_metrics`` reads the logits [B, T, V] (the full-vocabulary
entropy needs every one of them): it is timed at B=4, T=512, V=8192 against the token
log-probs every policy-gradient loss computes from the same logits, and against the LM head
(hidden 512) that produced them. Blocks alternate within one run, one thread.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.conftest import PAIRED, block_medians
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    Timers,
    buffer_metrics,
    loss_metrics,
    policy_metrics,
    rollout_metrics,
)
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch

B, T = 64, 512
PB, V, H = 4, 8192, 512
K = LLM_LAYOUT_V1.key


def _hooks() -> None:
    torch.set_num_threads(1)
    batch = llm_batch(B, T)
    rb = RingBuffer(16 * B, seed=0)
    for _ in range(16):
        rb.extend(batch)
    out = {"loss_objective": torch.tensor(0.5), "loss_kl_to_ref": torch.tensor(0.01)}

    def step_hooks() -> None:
        timers = Timers()
        with timers.phase("rollout"):
            pass
        rollout_metrics(batch, timers.acc, learner_version=3)
        timers.rate("perf/gen_tokens_per_s", tokens=float(B * T), phase="rollout")
        loss_metrics(out, timers.acc)
        buffer_metrics(rb, timers.acc, writes=B, reads=B)
        timers.acc.values()

    small = llm_batch(PB, T, vocab_size=V)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(PB, T, H, generator=g)
    head = torch.randn(V, H, generator=g) / H**0.5
    logits = hidden @ head.T
    tokens = small.get(K("tokens"))

    med = block_medians(
        {
            "batch hooks": step_hooks,
            "RingBuffer extend + sample": lambda: (rb.extend(batch), rb.sample(B)),
        },
        rounds=40,
    )
    PAIRED["hooks: rollout+loss+buffer+timers, us per step (B=64, T=512)"] = (
        med["batch hooks"] * 1e6
    )
    PAIRED["hooks: batch hooks / RingBuffer extend + sample of the batch"] = (
        med["batch hooks"] / med["RingBuffer extend + sample"]
    )
    pol = block_medians(
        {
            "policy_metrics": lambda: policy_metrics(small, logits, Accumulator()),
            "token_log_probs": lambda: token_log_probs(logits, tokens),
            "LM head": lambda: hidden @ head.T,
        },
        rounds=3,
    )
    PAIRED[f"hooks: policy_metrics / token log-probs (B={PB}, T={T}, V={V})"] = (
        pol["policy_metrics"] / pol["token_log_probs"]
    )
    PAIRED[f"hooks: policy_metrics / LM head matmul (hidden {H})"] = (
        pol["policy_metrics"] / pol["LM head"]
    )


def test_hook_cost(benchmark: Any) -> None:
    benchmark.pedantic(_hooks, rounds=1, iterations=1)
