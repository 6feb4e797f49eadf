"""A small GRPO-style loop on a tiny local model, logged with posttrain's hooks, then plotted.

Writes two runs (two learning rates) of ``--steps`` steps each under ``--out`` through real
sinks (``JsonlSink`` with histograms and completion tables, ``TensorboardSink``), and draws
``docs/img/dashboard-grpo.png`` with ``posttrain plot``. Nothing is downloaded: the policy is
``posttrain.testing.tiny_causal_lm`` (one Llama layer, hidden 32, vocabulary 64) built from a
config. The loop is built so every panel moves:

- the sampler is a copy of the policy refreshed every ``--sync-every`` steps, so staleness
  cycles 0, 1, 2 and the sampler's log-probs differ from the trainer's (mismatch KL);
- responses stop at an end token or at ``--max-new`` tokens (truncation);
- reward: the share of response tokens below 16, in quarters (ties give zero-std groups);
- ``--epochs`` PPO epochs a batch against the trainer's own log-probs before the update, the
  policy metrics taken in the last one (the ratio has moved off 1: clip fractions), a k3 KL
  penalty to a frozen reference, gradient clipping (grad norm), warmup then cosine decay.

Run: ``.venv/bin/python scripts/dashboard_run.py`` (about two minutes on 2 CPU cores). Not part
of the test run.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Timers,
    loss_metrics,
    optim_metrics,
    policy_metrics,
    rollout_metrics,
)
from posttrain.observability.distributions import log_completion_samples, log_distributions
from posttrain.observability.plot import main as plot_main
from posttrain.observability.sinks import Tee, TensorboardSink
from posttrain.reference_impls import JsonlSink
from posttrain.testing import tiny_causal_lm

K = LLM_LAYOUT_V1.key
VOCAB, EOS, PAD, GOOD = 64, 1, 0, 16


@torch.no_grad()
def sample(
    model: torch.nn.Module, prompts: torch.Tensor, max_new: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [B, P + max_new], attention and assistant masks, truncated flags: sampling at
    temperature 1 until EOS or ``max_new`` tokens."""
    b, p = prompts.shape
    tokens = torch.cat([prompts, torch.full((b, max_new), PAD)], dim=1)
    attn = torch.zeros_like(tokens, dtype=torch.bool)
    attn[:, :p] = True
    done = torch.zeros(b, dtype=torch.bool)
    for t in range(p, p + max_new):
        logits = model(input_ids=tokens[:, :t], attention_mask=attn[:, :t].long()).logits[:, -1]
        nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).squeeze(-1)
        live = ~done
        tokens[live, t] = nxt[live]
        attn[live, t] = True
        done |= nxt == EOS
    asst = attn.clone()
    asst[:, :p] = False
    return tokens, attn, asst, ~done


def run(out: Path, *, lr: float, steps: int, seed: int, args: argparse.Namespace) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = tiny_causal_lm(vocab_size=VOCAB, seed=seed)
    with torch.no_grad():  # a likelier end token: responses of mixed lengths from the start
        policy.lm_head.weight[EOS] *= 0.0
        policy.lm_head.weight[EOS] += 0.02 * torch.randn(policy.lm_head.weight.shape[1])
    reference = copy.deepcopy(policy).eval()
    sampler = copy.deepcopy(policy).eval()
    sampler_version = 0
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    warmup = 5

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sink = Tee(JsonlSink(out), TensorboardSink(out / "tb"))
    n_prompts, group = args.prompts, args.group
    for step in range(steps):
        timers = Timers()
        acc = timers.acc
        t_step = time.perf_counter()
        if step - sampler_version >= args.sync_every:
            sampler.load_state_dict(policy.state_dict())
            sampler_version = step
        with timers.phase("rollout"):
            prompts = torch.randint(2, VOCAB, (n_prompts, 4), generator=gen).repeat_interleave(
                group, 0
            )
            tokens, attn, asst, truncated = sample(sampler, prompts, args.max_new, gen)
            with torch.no_grad():
                s_lp = token_log_probs(
                    sampler(input_ids=tokens, attention_mask=attn.long()).logits, tokens
                )
                ref_lp = token_log_probs(
                    reference(input_ids=tokens, attention_mask=attn.long()).logits, tokens
                )
        gen_tokens = float(asst.sum())
        timers.rate("perf/gen_tokens_per_s", tokens=gen_tokens, phase="rollout")
        good = ((tokens < GOOD) & (tokens != EOS) & asst).sum(-1).float()
        reward = torch.floor(4 * good / asst.sum(-1).clamp_min(1)) / 4
        r = reward.view(n_prompts, group)
        adv = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).reshape(-1)
        nan_out = float("nan")
        td = TensorDict(
            {
                K("tokens"): tokens,
                K("attention_mask"): attn,
                K("assistant_mask"): asst,
                K("sample_log_probs"): torch.where(asst, s_lp, nan_out),
                K("ref_log_probs"): torch.where(asst, ref_lp, nan_out),
                K("reward"): reward,
                K("advantage"): adv,
                K("group_id"): torch.arange(n_prompts).repeat_interleave(group),
                K("policy_version"): torch.full((n_prompts * group,), sampler_version),
            },
            batch_size=[n_prompts * group],
        )
        rollout_metrics(td, acc, learner_version=step, truncated=truncated)
        log_distributions(sink, td, step)
        words = [
            " ".join(f"t{int(x)}" for x in row[m])
            for row, m in zip(tokens, attn & ~asst, strict=True)
        ]
        texts = [
            " ".join(f"t{int(x)}" for x in row[m]) for row, m in zip(tokens, asst, strict=True)
        ]
        log_completion_samples(sink, words, texts, reward, step, k=4)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        mask = asst.clone()
        mask[:, 0] = False
        n_tok = mask.sum().clamp_min(1)
        with timers.phase("train"):
            with torch.no_grad():
                old_lp = token_log_probs(
                    policy(input_ids=tokens, attention_mask=attn.long()).logits, tokens
                )
            for epoch in range(args.epochs):
                logits = policy(input_ids=tokens, attention_mask=attn.long()).logits
                lp = token_log_probs(logits, tokens)
                ratio = torch.where(mask, (lp - old_lp).exp(), 1.0)
                a = adv[:, None]
                pg = -torch.minimum(ratio * a, ratio.clamp(1 - 0.2, 1 + 0.2) * a)
                d = torch.where(mask, ref_lp - lp, 0.0)
                kl = d.exp() - d - 1
                obj = torch.where(mask, pg, 0.0).sum() / n_tok
                kl_loss = 0.05 * torch.where(mask, kl, 0.0).sum() / n_tok
                if epoch == args.epochs - 1:  # the last epoch: the ratio has moved off 1
                    policy_metrics(td, logits.detach(), acc, clip=(0.2, 0.2), old_log_probs=old_lp)
                    loss_metrics(
                        {"loss_objective": obj.detach(), "loss_kl_to_ref": kl_loss.detach()}, acc
                    )
                opt.zero_grad()
                (obj + kl_loss).backward()  # type: ignore[no-untyped-call]
                norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0)
                if epoch == args.epochs - 1:
                    optim_metrics(norm, opt.param_groups[0]["lr"], acc)
                opt.step()
        timers.rate(
            "perf/train_tokens_per_s", tokens=args.epochs * float(attn.sum()), phase="train"
        )
        acc.add("time/step_s", time.perf_counter() - t_step)
        vals = acc.log_to(sink, step)
        if step % 10 == 0 or step == steps - 1:
            print(
                f"{out.name} step {step}: reward {vals['rollout/reward/mean']:.3f} "
                f"kl {vals.get('policy/kl_ref/k3', 0):.2e} lr {vals['optim/lr']:.1e}"
            )
    sink.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/posttrain-dashboard-run"))
    p.add_argument("--png", type=Path, default=Path("docs/img/dashboard-grpo.png"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new", type=int, default=12)
    p.add_argument("--sync-every", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    for name, lr in (("grpo_lr3e-3", 3e-3), ("grpo_lr1e-3", 1e-3)):
        run(args.out / name, lr=lr, steps=args.steps, seed=0, args=args)
    plot_main(
        [
            str(args.out),
            "--out",
            str(args.png),
            "--title",
            f"posttrain hooks on a tiny GRPO loop: {args.steps} steps, two learning rates",
        ]
    )


if __name__ == "__main__":
    main()
