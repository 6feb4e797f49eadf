"""Reward-model training (Bradley-Terry on chosen/rejected pairs) logged with posttrain's
hooks, twice on the same pairs: a plain PyTorch loop and TRL's ``RewardTrainer``.

A tiny policy fills a replay buffer with GRPO groups (4 answers per prompt, scored by a
verifiable reward); each group's answers become pairs whose rewards differ. Both loops train
a tiny locally built ``LlamaForSequenceClassification`` and log the catalogue's
``reward_model/*`` (pair accuracy, margin and its spread, Bradley-Terry loss),
``loss/total``, ``optim/*``, ``time/*``, ``perf/train_tokens_per_s`` and ``buffer/*`` through
one ``JsonlSink`` each.

Run: python examples/reward_model_training.py [OUT_DIR]   (CPU, tiny local models, seconds)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from transformers import TrainerCallback
from trl.trainer.reward_config import RewardConfig
from trl.trainer.reward_trainer import RewardTrainer

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl.preference import reward_dataset
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    Timers,
    buffer_metrics,
    loss_metrics,
    optim_metrics,
    reward_model_metrics,
)
from posttrain.reference_impls import JsonlSink, RingBuffer
from posttrain.testing import tiny_causal_lm, tiny_reward_model

K = LLM_LAYOUT_V1.key
EOS, PAD, GOOD = 2, 0, 16
PROMPTS, N, MAX_NEW, ROUNDS, STEPS, PAIRS = 4, 4, 6, 2, 4, 4


@torch.no_grad()
def grpo_groups(
    model: Any, prompts: torch.Tensor, n: int, max_new: int, gen: torch.Generator
) -> TensorDict:
    """A GRPO rollout batch: ``n`` sampled answers per prompt, rewards and group-normalized
    advantages."""
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
    good = ((tokens < GOOD) & (tokens != EOS) & asst).sum(-1).float()
    reward = torch.floor(4 * good / asst.sum(-1).clamp_min(1)) / 4
    r = reward.view(-1, n)
    adv = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)
    return TensorDict(
        {
            K("tokens"): tokens,
            K("attention_mask"): attn,
            K("assistant_mask"): asst,
            K("reward"): reward,
            K("advantage"): adv.reshape(-1),
            K("group_id"): torch.arange(b // n).repeat_interleave(n),
        },
        batch_size=[b],
    )


def fill_buffer(seed: int = 0) -> RingBuffer:
    """The GRPO-filled buffer the pairs come from."""
    gen = torch.Generator().manual_seed(seed)
    policy = tiny_causal_lm(seed=seed)
    buffer = RingBuffer(capacity=PROMPTS * N * ROUNDS, seed=seed)
    for r in range(ROUNDS):
        prompts = torch.randint(3, 64, (PROMPTS, 3), generator=gen)
        batch = grpo_groups(policy, prompts, N, MAX_NEW, gen)
        batch.set(K("group_id"), batch.get(K("group_id")) + r * PROMPTS)
        buffer.extend(batch)
    return buffer


def pad_pairs(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows, right-padded: input ids and attention mask [2P, T]."""
    seqs = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD)
    attn = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = True
    return ids, attn


def bt_step(
    model: Any, opt: torch.optim.Optimizer, rows: list[dict[str, Any]], acc: Accumulator
) -> float:
    """One Bradley-Terry step on ``rows`` (pairs): its metrics into ``acc``."""
    ids, attn = pad_pairs(rows)
    scores = model(input_ids=ids, attention_mask=attn.long()).logits.squeeze(-1)
    chosen, rejected = scores.chunk(2)
    loss = torch.nn.functional.softplus(rejected - chosen).mean()
    reward_model_metrics(chosen, rejected, acc)
    loss_metrics({"loss_reward_model": loss.detach()}, acc)
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optim_metrics(norm, opt.param_groups[0]["lr"], acc)
    opt.step()
    return float(loss.detach())


def plain_loop(
    buffer: RingBuffer, pairs: Any, out: Path, *, steps: int = STEPS, seed: int = 1
) -> list[float]:
    """The plain loop: ``steps`` steps over ``pairs`` in order, ``PAIRS`` pairs a step."""
    model = tiny_reward_model(seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = JsonlSink(out)
    losses = []
    for step in range(steps):
        timers = Timers()
        acc, t0 = timers.acc, time.perf_counter()
        rows = [pairs[(step * PAIRS + i) % len(pairs)] for i in range(PAIRS)]
        with timers.phase("train"):
            losses.append(bt_step(model, opt, rows, acc))
        tokens = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
        timers.rate("perf/train_tokens_per_s", tokens=tokens, phase="train")
        buffer_metrics(buffer, acc, reads=len(buffer) if step == 0 else 0)
        acc.add("time/step_s", time.perf_counter() - t0)
        vals = acc.log_to(sink, step)
        print(
            f"plain step {step}: loss {vals['reward_model/loss']:.4f} "
            f"accuracy {vals['reward_model/accuracy']:.2f} margin {vals['reward_model/margin']:.4f}"
        )
    sink.close()
    return losses


class HookedRewardTrainer(RewardTrainer):
    """TRL's ``RewardTrainer`` whose every loss call also feeds the hooks (scores as TRL
    computed them: the first half of the batch chosen, the second rejected)."""

    def __init__(self, *args: Any, acc: Accumulator, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acc = acc
        self.tokens = 0.0

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)  # type: ignore[no-untyped-call]
        chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        reward_model_metrics(chosen, rejected, self.acc)
        loss_metrics({"loss_reward_model": loss.detach()}, self.acc)
        self.tokens += float(inputs["attention_mask"].sum())
        return (loss, outputs) if return_outputs else loss


class CatalogueLog(TrainerCallback):
    """Each optimizer step's hook metrics, with the Trainer's own grad norm and learning
    rate (``logging_steps=1``), into ``sink``."""

    def __init__(self, trainer: HookedRewardTrainer, buffer: RingBuffer, sink: Any) -> None:
        self.trainer, self.buffer, self.sink = trainer, buffer, sink
        self.t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        seconds = time.perf_counter() - self.t0
        acc = self.trainer.acc
        acc.add("time/train_s", seconds)
        acc.add("time/step_s", seconds)
        acc.add("perf/train_tokens_per_s", self.trainer.tokens, seconds)
        acc.add("perf/train_tokens_per_s_per_rank", self.trainer.tokens, seconds)
        self.trainer.tokens = 0.0

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if not logs or "grad_norm" not in logs:
            return
        acc = self.trainer.acc
        optim_metrics(logs["grad_norm"], logs["learning_rate"], acc)
        buffer_metrics(self.buffer, acc, reads=len(self.buffer) if state.global_step == 1 else 0)
        acc.log_to(self.sink, state.global_step - 1)
        self.trainer.acc = Accumulator()


def trl_loop(
    buffer: RingBuffer,
    pairs: Any,
    out: Path,
    *,
    steps: int = STEPS,
    seed: int = 1,
    history: list[dict[str, Any]] | None = None,
) -> list[float]:
    """TRL's RewardTrainer on the same pairs (no margin column: the plain Bradley-Terry loss);
    TRL's own logs go into ``history`` when given."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = HookedRewardTrainer(
            model=tiny_reward_model(seed=seed),
            args=RewardConfig(
                output_dir=tmp,
                max_steps=steps,
                per_device_train_batch_size=PAIRS,
                learning_rate=1e-3,
                lr_scheduler_type="constant",
                disable_tqdm=True,
                max_grad_norm=1.0,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                logging_steps=1,
                seed=seed,
            ),
            train_dataset=pairs.remove_columns("margin"),
            processing_class=word_level_tokenizer(tiny_causal_lm().config),
            acc=Accumulator(),
        )
        sink = JsonlSink(out)
        trainer.add_callback(CatalogueLog(trainer, buffer, sink))
        trainer.train()
        sink.close()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if history is not None:
        history.extend(trainer.state.log_history)
    print("RewardTrainer losses:", losses)
    return losses


def run(out: Path, *, steps: int = STEPS) -> list[float]:
    """Both loops on the pairs of one GRPO-filled buffer: ``out/plain`` and ``out/trl``."""
    torch.manual_seed(0)
    buffer = fill_buffer()
    pairs = reward_dataset(buffer, len(buffer), pairs="all")
    print(f"{len(pairs)} pairs from {len(buffer)} answers")
    return plain_loop(buffer, pairs, out / "plain", steps=steps) + trl_loop(
        buffer, pairs, out / "trl", steps=steps
    )


def main(out: str | None = None) -> list[float]:
    if out is not None:
        return run(Path(out))
    with tempfile.TemporaryDirectory() as tmp:
        return run(Path(tmp))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
