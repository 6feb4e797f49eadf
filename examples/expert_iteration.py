"""Expert iteration (best-of-n rejection sampling) logged with posttrain's hooks: each round
a sampler synced from the policy generates n answers per prompt, the top k of each group by
reward go into a replay buffer, and the policy takes SFT steps on batches drawn from it.

The hooks are the ones a GRPO loop calls: ``rollout_metrics`` before selection,
``selection_metrics`` for what was kept, ``policy_metrics`` (entropy) and ``loss_metrics``
(``loss/nll``) on the SFT batch, ``optim_metrics``, ``Timers`` (rollout, weight sync, train,
tokens/s) and ``buffer_metrics``; one ``JsonlSink`` receives them.

Run: python examples/expert_iteration.py [OUT_DIR]   (CPU, a tiny local model, a few seconds)
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    Timers,
    buffer_metrics,
    loss_metrics,
    optim_metrics,
    policy_metrics,
    rollout_metrics,
    selection_metrics,
)
from posttrain.reference_impls import JsonlSink, RingBuffer
from posttrain.testing import tiny_causal_lm

K = LLM_LAYOUT_V1.key
EOS, PAD, GOOD = 2, 0, 16
PROMPTS, N, TOP_K, MAX_NEW, ROUNDS, SFT_BATCH = 4, 4, 1, 6, 4, 4


@torch.no_grad()
def generate(
    model: Any, prompts: torch.Tensor, n: int, max_new: int, gen: torch.Generator, version: int
) -> tuple[TensorDict, torch.Tensor]:
    """``n`` sampled answers per prompt (temperature 1, stop at EOS or ``max_new`` tokens) as
    a layout batch with group ids and the sampler's version; and the truncated flags."""
    prompts = prompts.repeat_interleave(n, 0)
    b, p = prompts.shape
    tokens = torch.cat([prompts, torch.full((b, max_new), PAD)], dim=1)
    attn = torch.zeros_like(tokens, dtype=torch.bool)
    attn[:, :p] = True
    done = torch.zeros(b, dtype=torch.bool)
    for t in range(p, p + max_new):
        logits = model(input_ids=tokens[:, :t], attention_mask=attn[:, :t].long()).logits[:, -1]
        logits[:, PAD] = -torch.inf  # the pad id never appears inside an answer
        nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).squeeze(-1)
        tokens[~done, t] = nxt[~done]
        attn[~done, t] = True
        done |= nxt == EOS
    asst = attn.clone()
    asst[:, :p] = False
    td = TensorDict(
        {
            K("tokens"): tokens,
            K("attention_mask"): attn,
            K("assistant_mask"): asst,
            K("reward"): low_token_share(tokens, asst),
            K("group_id"): torch.arange(b // n).repeat_interleave(n),
            K("policy_version"): torch.full((b,), version),
        },
        batch_size=[b],
    )
    return td, ~done


def low_token_share(tokens: torch.Tensor, asst: torch.Tensor) -> torch.Tensor:
    """The reward: the share of answer tokens below 16, in quarters (ties make flat groups)."""
    good = ((tokens < GOOD) & (tokens != EOS) & asst).sum(-1).float()
    return torch.floor(4 * good / asst.sum(-1).clamp_min(1)) / 4


def top_k(td: TensorDict, n: int, k: int) -> torch.Tensor:
    """One bool per sequence: the ``k`` best rewards of each group of ``n`` (first wins ties)."""
    r = td.get(K("reward")).view(-1, n)
    best = r.argsort(dim=-1, descending=True, stable=True)[:, :k]
    keep = torch.zeros_like(r, dtype=torch.bool).scatter_(1, best, True)
    return keep.reshape(-1)


def sft_step(policy: Any, opt: torch.optim.Optimizer, batch: TensorDict, acc: Accumulator) -> float:
    """One SFT step on the kept answers: the token-mean NLL of the assistant tokens; the
    entropy, loss and optimizer metrics of the step into ``acc``."""
    tokens, attn = batch.get(K("tokens")), batch.get(K("attention_mask"))
    mask = batch.get(K("assistant_mask")) & attn
    mask[:, 0] = False  # no logit predicts position 0
    logits = policy(input_ids=tokens, attention_mask=attn.long()).logits
    logp = token_log_probs(logits, tokens)
    loss = -torch.where(mask, logp, 0.0).sum() / mask.sum().clamp_min(1)
    policy_metrics(batch, logits.detach(), acc)
    loss_metrics({"loss_nll": loss.detach()}, acc)
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0)
    optim_metrics(norm, opt.param_groups[0]["lr"], acc)
    opt.step()
    return float(loss.detach())


def run(out: Path, *, rounds: int = ROUNDS, seed: int = 0) -> list[float]:
    """Expert iteration for ``rounds`` rounds, one step of metrics per round into ``out``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = tiny_causal_lm(seed=seed)
    sampler = copy.deepcopy(policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    buffer = RingBuffer(capacity=PROMPTS * TOP_K * rounds, seed=seed)
    sink = JsonlSink(out)
    losses = []
    for step in range(rounds):
        timers = Timers()
        acc, t0 = timers.acc, time.perf_counter()
        with timers.phase("weight_sync"):
            sampler.load_state_dict(policy.state_dict())
        with timers.phase("rollout"):
            prompts = torch.randint(3, 64, (PROMPTS, 3), generator=gen)
            cand, truncated = generate(sampler, prompts, N, MAX_NEW, gen, version=step)
        asst = cand.get(K("assistant_mask"))
        timers.rate("perf/gen_tokens_per_s", tokens=float(asst.sum()), phase="rollout")
        # Before selection: every candidate (the reward function's own series too).
        rollout_metrics(
            cand,
            acc,
            learner_version=step,
            truncated=truncated,
            reward_fns={"low_token_share": cand.get(K("reward"))},
            histograms=True,
        )
        keep = top_k(cand, N, TOP_K)
        selection_metrics(cand, keep, acc)
        buffer.extend(cand[keep])
        batch = buffer.sample(SFT_BATCH)
        with timers.phase("train"):
            losses.append(sft_step(policy, opt, batch, acc))
        timers.rate(
            "perf/train_tokens_per_s",
            tokens=float(batch.get(K("attention_mask")).sum()),
            phase="train",
        )
        # Staleness of the kept answers the step trained on (the buffer holds older rounds).
        ages = (step - batch.get(K("policy_version"))).double()
        acc.add("staleness/mean", ages.sum(), ages.numel())
        acc.add("staleness/max", ages.max())
        buffer_metrics(buffer, acc, writes=int(keep.sum()), reads=SFT_BATCH)
        acc.add("time/step_s", time.perf_counter() - t0)
        vals = acc.log_to(sink, step)
        print(
            f"round {step}: reward {vals['rollout/reward/mean']:.3f} -> kept "
            f"{vals['selection/reward/mean']:.3f} (rate {vals['selection/rate']:.2f}), "
            f"nll {vals['loss/nll']:.3f}, buffer {vals['buffer/utilization']:.2f}"
        )
    sink.close()
    return losses


def main(out: str | None = None) -> list[float]:
    if out is not None:
        return run(Path(out))
    with tempfile.TemporaryDirectory() as tmp:
        return run(Path(tmp))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
