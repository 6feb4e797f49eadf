"""NeMo-RL's async GRPO step loop walked on posttrain's pieces with a tiny model, end to end.

The calls ``async_grpo_train`` (``nemo_rl/algorithms/grpo.py``, 7ea279a) makes on the replay
buffer and the weight synchronizer, in its order: the start-up wait (``size``,
``has_complete_batch(step)``, the look-ahead ``has_complete_batch(step + 1)``), then per
step ``size``, ``sample``, ``BatchedDataDict.from_batches`` of the groups, advantages
(``compute_advantage`` then ``_clip_grpo_advantages``), the loss, the refit
(``refit_policy_generation`` -> ``weight_synchronizer.sync_weights``), ``weight_version += 1``,
and at a checkpoint ``save_to_path``; a resumed run ``load_from_path(num_prompts_per_step,
current_training_step, max_age_steps)``. The collector's side (``get_last_target_weight_
already_generated``, ``get_trajectories_needed``, ``add``) runs in-process between steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.adapters.nemo_rl.loss import ContractAsNemoLoss, global_counts
from posttrain.adapters.nemo_rl.mirror.advantages import clip_advantages, grpo_advantage
from posttrain.adapters.nemo_rl.mirror.batched_data_dict import BatchedDataDict
from posttrain.adapters.nemo_rl.mirror.batching import flatten_message_logs
from posttrain.adapters.nemo_rl.replay_buffer import NemoAsyncReplayBuffer
from posttrain.adapters.nemo_rl.weight_sync import NemoShardedWeightSynchronizer, ShardAssembler
from posttrain.reference_impls import PolicyGradientLoss, in_process_weight_sync
from posttrain.testing import tiny_causal_lm

NPS, GENS, NEW, AGE, STEPS = 2, 2, 3, 1, 3  # prompts/step, generations/prompt, tokens, age


class Traced:
    """Records the method calls made on the wrapped object, in order."""

    def __init__(self, inner: Any, log: list[str], tag: str) -> None:
        self._inner, self._log, self._tag = inner, log, tag

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            self._log.append(f"{self._tag}.{name}")
            return attr(*a, **k)

        return call


class Worker:
    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.model, self.names = model, names

    def state_shard(self) -> dict[str, torch.Tensor]:
        sd = self.model.state_dict()
        return {n: sd[n] for n in self.names}


class Colocated:
    """The policy's and generation's offload/wake hooks (no-ops on CPU), logged."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def offload_before_refit(self) -> None:
        self.log.append("policy.offload_before_refit")

    def offload_after_refit(self) -> None:
        self.log.append("policy.offload_after_refit")

    def prepare_for_generation(self, tags: list[str] | None = None) -> None:
        self.log.append(f"policy_generation.prepare_for_generation({tags})")


def rollout(generator: torch.nn.Module, prompt: list[int], seed: int) -> dict[str, Any]:
    """One prompt group as the collector pushes it: message_log, loss_multiplier, rewards."""
    g = torch.Generator().manual_seed(seed)
    logs, rewards = [], []
    with torch.no_grad():
        for _ in range(GENS):
            ids = torch.tensor([prompt])
            lps = []
            for _ in range(NEW):
                logp = torch.log_softmax(generator(input_ids=ids).logits[0, -1], -1)
                tok = torch.multinomial(logp.exp(), 1, generator=g)
                lps.append(logp[tok].item())
                ids = torch.cat([ids, tok[None]], 1)
            gen = ids[0, len(prompt) :]
            logs.append(
                [
                    {"role": "user", "content": "q", "token_ids": torch.tensor(prompt)},
                    {
                        "role": "assistant",
                        "content": "a",
                        "token_ids": gen,
                        "generation_logprobs": torch.tensor(lps),
                    },
                ]
            )
            rewards.append(float((gen % 2 == 0).float().mean()))  # even tokens are "right"
    batch = BatchedDataDict(
        {
            "message_log": logs,
            "length": torch.tensor([len(prompt) + NEW] * GENS, dtype=torch.int32),
            "loss_multiplier": torch.ones(GENS),
            "idx": [seed] * GENS,
            "extra_env_info": [{"ground_truth": "even"}] * GENS,
            "total_reward": torch.tensor(rewards),
        }
    )
    return {"batch": batch, "rollout_metrics": {"mean_gen_tokens": float(NEW)}, "timestamp": 0.0}


def collect(buffer: Any, generator: torch.nn.Module, weight_version: int, step: int) -> None:
    """The collector's calls: targets from last generated + 1 up to one step ahead."""
    last = buffer.get_last_target_weight_already_generated()
    for target in range(max(step, last + 1), step + 1 + AGE):
        for j in range(buffer.get_trajectories_needed(target, NPS, AGE)):
            group = rollout(generator, [3 + j, 5 + target % 4], seed=100 * target + j)
            assert buffer.add(group, weight_version, target) == "success"


def next_token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def test_async_grpo_step_loop_runs_on_posttrain_pieces(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=1)
    start = {k: v.clone() for k, v in trainer.state_dict().items()}
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    log: list[str] = []
    names = sorted(trainer.state_dict())
    sender, receiver = in_process_weight_sync(generator)
    hooks = Colocated(log)
    sync = Traced(
        NemoShardedWeightSynchronizer(
            [Worker(trainer, names[i::2]) for i in range(2)],
            ShardAssembler(sender, 2),
            receiver,
            colocated=True,
            policy=hooks,
            policy_generation=hooks,
        ),
        log,
        "weight_synchronizer",
    )
    sync.init_communicator()
    loss_fn = ContractAsNemoLoss(lambda p: PolicyGradientLoss(p, clip_epsilon=0.2, kl_coef=0.0))
    ckpt = str(tmp_path / "replay_buffer.pt")

    def new_buffer() -> Any:
        return Traced(NemoAsyncReplayBuffer(NPS * AGE * 2, False), log, "replay_buffer")

    buffer = new_buffer()
    step = weight_version = 0
    losses = []
    waiting = True  # the start-up wait runs at start and after a resume
    while step < STEPS:
        collect(buffer._inner, generator, weight_version, step)
        # Start-up wait (grpo.py) before the first step and after a resume.
        if waiting:
            waiting = False
            buffer.size()
            assert buffer.has_complete_batch(step, NPS, AGE)
            assert buffer.has_complete_batch(step + 1, NPS, AGE)  # the look-ahead barrier
        buffer.size()
        sample = buffer.sample(
            num_prompt_groups=NPS, current_weight_version=weight_version, max_age_steps=AGE
        )
        assert sample is not None
        assert sample["avg_trajectory_age"] <= AGE
        repeated = BatchedDataDict.from_batches([t["batch"] for t in sample["trajectories"]])
        assert repeated.size == NPS * GENS
        flat = flatten_message_logs(repeated["message_log"])
        ids = flat["token_ids"]
        with torch.no_grad():
            prev = torch.cat([torch.zeros(len(ids), 1), next_token_logprobs(trainer, ids)], 1)
        data = BatchedDataDict(
            {
                "input_ids": ids,
                "input_lengths": flat["input_lengths"],
                "token_mask": flat["token_loss_mask"],
                "sample_mask": repeated["loss_multiplier"],
                "generation_logprobs": flat["generation_logprobs"],
                "prev_logprobs": prev * flat["token_loss_mask"],
                "reference_policy_logprobs": prev * flat["token_loss_mask"],
            }
        )
        mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
        prompts = torch.stack([log_[0]["token_ids"] for log_ in repeated["message_log"]])
        adv = grpo_advantage(prompts, repeated["total_reward"], mask)
        data["advantages"] = clip_advantages(adv, -5.0, 5.0).contiguous()
        seqs, toks = global_counts(data)
        opt.zero_grad()
        loss, metrics = loss_fn(
            next_token_logprobs=next_token_logprobs(trainer, ids),
            data=data,
            global_valid_seqs=seqs,
            global_valid_toks=toks,
        )
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss))
        assert torch.isfinite(loss)
        # refit_policy_generation: the synchronizer branch.
        metrics = sync.sync_weights(timer=None, kv_scales=None)
        weight_version += 1
        assert metrics["weight_version"] == weight_version
        step += 1
        if step == 1:  # a checkpoint, then a resume into a fresh buffer actor
            buffer.save_to_path(ckpt)
            collect(buffer._inner, generator, weight_version, step)
            buffer.save_to_path(ckpt)
            buffer = new_buffer()
            meta = buffer.load_from_path(
                ckpt, num_prompts_per_step=NPS, current_training_step=step, max_age_steps=AGE
            )
            assert meta["num_trajectories"] >= NPS
            waiting = True
    # Generator holds the trainer's weights, which training moved.
    sd, gd = trainer.state_dict(), generator.state_dict()
    assert all(torch.equal(sd[k], gd[k]) for k in sd)
    assert any(not torch.equal(sd[k], start[k]) for k in sd)
    assert receiver.version == STEPS
    refit = [
        "weight_synchronizer.sync_weights",
        "policy.offload_before_refit",
        "policy_generation.prepare_for_generation(['weights'])",
        "policy.offload_after_refit",
        "policy_generation.prepare_for_generation(['kv_cache'])",
    ]
    wait = ["replay_buffer.size"] + ["replay_buffer.has_complete_batch"] * 2
    take = ["replay_buffer.size", "replay_buffer.sample"]
    ckpt_calls = ["replay_buffer.save_to_path", "replay_buffer.save_to_path"]
    expected = [
        "weight_synchronizer.init_communicator",
        *wait, *take, *refit, *ckpt_calls, "replay_buffer.load_from_path",
        *wait, *take, *refit,
        *take, *refit,
    ]  # fmt: skip
    assert log == expected
