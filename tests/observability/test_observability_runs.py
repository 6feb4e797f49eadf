"""Issue 7's done-when: a TRL GRPOTrainer run and a TorchRL GRPO run on the same tiny setup emit
the catalogue's core metrics under the same names, read back from TensorBoard event files (with
TensorBoard's reader), from an MLflow tracking store (with MLflow's client) and from an offline W&B
run (with W&B's reader of its .wandb log)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters._layout import to_padded
from posttrain.adapters.torchrl.loggers import read_tensorboard, tensorboard_logger
from posttrain.adapters.torchrl.loss import make_loss
from posttrain.adapters.torchrl.rollout import llm_collector
from posttrain.adapters.trl import CaptureRollouts, hf_reward_model, trl_reward_func
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    Timers,
    loss_metrics,
    policy_metrics,
    rollout_metrics,
)
from posttrain.observability.sinks import MlflowSink, Tee, WandbSink, read_wandb
from posttrain.testing import tiny_causal_lm, tiny_reward_model

K = LLM_LAYOUT_V1.key
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
CORE = {
    "policy/kl_ref/k3",
    "policy/entropy",
    "policy/clip_frac/low",
    "policy/clip_frac/high",
    "rollout/reward/mean",
    "rollout/response_len/mean",
    "rollout/prompt_len/mean",
    "staleness/mean",
    "time/rollout_s",
    "perf/gen_tokens_per_s",
    "loss/total",
}


Scalars = dict[str, list[tuple[int, float]]]


def _trl_run(tmp: Path) -> tuple[Scalars, Scalars, Scalars]:
    from datasets import Dataset
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from posttrain.adapters.trl.callback import CatalogueCallback, install
    from posttrain.reference_impls import RingBuffer

    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.padding_side = "left"
    sink = Tee(
        tensorboard_logger(tmp / "trl"),
        MlflowSink(tmp / "mlflow", run_name="trl"),
        WandbSink(tmp / "wandb-trl", run_name="trl"),
    )
    # With beta > 0 TRL loads a reference copy by the model's path: save the tiny model locally.
    tiny_causal_lm().save_pretrained(tmp / "policy")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    capture = CaptureRollouts(RingBuffer(64), width=16, metrics=Accumulator())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(tmp / "policy"),
            reward_funcs=[trl_reward_func(hf_reward_model(tiny_reward_model()), tok, name="rm")],
            args=GRPOConfig(
                output_dir=str(tmp / "out"),
                max_steps=2,
                per_device_train_batch_size=4,
                num_generations=2,
                max_completion_length=4,
                beta=0.04,  # a reference model: TRL then logs its k3 KL
                logging_steps=1,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
            ),
            train_dataset=Dataset.from_dict({"prompt": ["t5 t6 t7", "t8 t9", "t10", "t11 t12"]}),
            processing_class=tok,
            rollout_func=capture,
        )
        install(trainer, CatalogueCallback(capture, sink=sink))
        trainer.train()
    sink.close()
    return read_tensorboard(tmp / "trl"), _run(tmp / "mlflow", "trl"), read_wandb(tmp / "wandb-trl")


def _torchrl_run(tmp: Path) -> tuple[Scalars, Scalars, Scalars]:
    torch.manual_seed(0)
    policy = tiny_causal_lm()
    reference = tiny_causal_lm()
    src = llm_collector(policy, [[5, 6, 7]] * 4, 2, max_new_tokens=4, adapted=True)
    reward = hf_reward_model(tiny_reward_model())
    loss_fn = make_loss("GRPOLoss", adapted=True)(policy, kl_to_ref_coeff=0.04)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    sink = Tee(
        tensorboard_logger(tmp / "torchrl"),
        MlflowSink(tmp / "mlflow", run_name="torchrl"),
        WandbSink(tmp / "wandb-torchrl", run_name="torchrl"),
    )
    timers = Timers()
    it = iter(src)
    for step in range(2):
        with timers.phase("rollout"):
            batch = next(it)
        batch = reward(batch)
        acc = timers.acc
        rollout_metrics(batch, acc, learner_version=src.policy_version)  # the documented wiring
        timers.rate(
            "perf/gen_tokens_per_s",
            tokens=float(sum(int(x.get(K("assistant_mask")).sum()) for x in batch.tensordicts)),
            phase="rollout",
        )
        dense = to_padded(batch)
        r = dense.get(K("reward"))
        dense.set(K("advantage"), (r - r.mean()) / (r.std() + 1e-6))
        tokens, attn = dense.get(K("tokens")), dense.get(K("attention_mask"))
        with torch.no_grad():
            ref_logits = reference(input_ids=tokens, attention_mask=attn.long()).logits
            from posttrain.contracts.alignment import token_log_probs

            dense.set(K("ref_log_probs"), token_log_probs(ref_logits, tokens))
            policy_metrics(dense, policy(input_ids=tokens, attention_mask=attn.long()).logits, acc)
        out = loss_fn(dense)
        loss_metrics(out, acc)
        opt.zero_grad()
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        opt.step()
        src.update_policy_weights_(policy.state_dict())
        acc.log_to(sink, step + 1)
        timers.acc = Accumulator()
    src.shutdown()
    sink.close()
    return (
        read_tensorboard(tmp / "torchrl"),
        _run(tmp / "mlflow", "torchrl"),
        read_wandb(tmp / "wandb-torchrl"),
    )


def _run(directory: Path, name: str) -> Scalars:
    """One MLflow run's metrics, through MLflow's client."""
    from mlflow.tracking import MlflowClient

    from posttrain.observability.sinks import EXPERIMENT, mlflow_uri

    client = MlflowClient(tracking_uri=mlflow_uri(directory))
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]
    return {
        key: sorted(
            (int(m.step), float(m.value)) for m in client.get_metric_history(run.info.run_id, key)
        )
        for key in run.data.metrics
    }


def test_trl_and_torchrl_emit_the_core_metrics_under_the_same_names(tmp_path: Path) -> None:
    trl, trl_mlflow, trl_wandb = _trl_run(tmp_path)
    torchrl, torchrl_mlflow, torchrl_wandb = _torchrl_run(tmp_path)
    runs = [
        ("TRL tb", trl),
        ("TorchRL tb", torchrl),
        ("TRL mlflow", trl_mlflow),
        ("TorchRL mlflow", torchrl_mlflow),
        ("TRL wandb", trl_wandb),
        ("TorchRL wandb", torchrl_wandb),
    ]
    for name, run in runs:
        missing = sorted(CORE - set(run))
        assert not missing, f"{name} run lacks {missing}"
        for metric in CORE:
            steps = [s for s, _ in run[metric]]
            values = [v for _, v in run[metric]]
            assert steps == [1, 2], (name, metric, steps)
            assert all(math.isfinite(v) for v in values), (name, metric, values)
    assert all(v >= 0 for _, v in trl["policy/kl_ref/k3"])
    # One Tee wrote all three backends: the same values (TensorBoard keeps float32).
    for tb, wb in ((trl, trl_wandb), (torchrl, torchrl_wandb)):
        for metric in CORE:
            assert [s for s, _ in wb[metric]] == [s for s, _ in tb[metric]]
            assert all(
                math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30)
                for (_, a), (_, b) in zip(tb[metric], wb[metric], strict=True)
            ), (metric, tb[metric], wb[metric])
    # The dashboard draws from what the backends hold (TensorBoard here, MLflow for the other).
    from posttrain.observability.plot import dashboard, main, read_run

    png = dashboard(read_run(tmp_path / "torchrl"), tmp_path / "torchrl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        main([str(tmp_path / "mlflow"), "--mlflow-run", "trl", "--out", str(tmp_path / "trl.png")])
        == 0
    )
    assert (tmp_path / "trl.png").stat().st_size > 10_000
    assert set(read_run(tmp_path / "wandb-trl")) == set(trl_wandb)


class _Points:
    """A MetricSinkV1 that keeps every point: name -> {step: value}."""

    def __init__(self) -> None:
        self.points: dict[str, dict[int, float]] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.points.setdefault(name, {})[int(step or 0)] = float(value)


def test_trl_callback_values_equal_trls_own_and_the_hooks_on_the_same_batches(
    tmp_path: Path,
) -> None:
    """One generation of 8 completions serves two optimizer steps (steps_per_generation=2):
    staleness reads 0 then 1. At the first step the callback's rollout values equal TRL's own
    per-generation statistics (one generation in the window, so TRL's means are exact), and
    the hooks run on the same batch with the initial policy give TRL's entropy."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from posttrain.adapters.trl.callback import CatalogueCallback, install

    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.padding_side = "left"
    tiny_causal_lm().save_pretrained(tmp_path / "policy")
    initial = tiny_causal_lm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trl_logs: list[dict[str, float]] = []

    class Keep(TrainerCallback):
        def on_log(
            self,
            args: object,
            state: object,
            control: object,
            logs: dict[str, float] | None = None,
            **kw: object,
        ) -> None:
            if logs is not None:
                trl_logs.append(dict(logs))

    sink = _Points()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(tmp_path / "policy"),
            reward_funcs=[trl_reward_func(hf_reward_model(tiny_reward_model()), tok, name="rm")],
            args=GRPOConfig(
                output_dir=str(tmp_path / "out"),
                max_steps=2,
                per_device_train_batch_size=4,
                steps_per_generation=2,
                num_generations=2,
                max_completion_length=4,
                temperature=0.7,
                logging_steps=1,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
            ),
            train_dataset=Dataset.from_dict(
                {"prompt": ["t5 t6 t7", "t8 t9", "t10", "t11 t12"] * 2}
            ),
            processing_class=tok,
        )
        cb = install(trainer, CatalogueCallback(sink=sink, keep_batches=True))
        trainer.add_callback(Keep())
        trainer.train()
    p = sink.points
    assert (p["staleness/mean"], p["staleness/max"]) == ({1: 0.0, 2: 1.0}, {1: 0.0, 2: 1.0})
    first = trl_logs[0]
    n = 8
    same = {
        "rollout/reward/mean": first["reward"],
        # TRL's nanstd is unbiased; the catalogue's std is the population's.
        "rollout/reward/std": first["reward_std"] * math.sqrt((n - 1) / n),
        "rollout/reward_fn/rm/mean": first["rewards/rm/mean"],
        "rollout/group/zero_std_frac": first["frac_reward_zero_std"],
        "rollout/response_len/mean": first["completions/mean_length"],
        "rollout/response_len/min": first["completions/min_length"],
        "rollout/response_len/max": first["completions/max_length"],
        "rollout/truncated_frac": first["completions/clipped_ratio"],
        "policy/entropy": first["entropy"],
        "loss/total": first["loss"],
    }
    for name, want in same.items():
        assert math.isclose(p[name][1], want, rel_tol=1e-5, abs_tol=1e-6), (name, p[name], want)
    assert "rollout/reward/mean" not in {k for k, v in p.items() if 2 in v}  # no generation
    # The hooks over the same micro-batch at the initial weights give TRL's entropy (which
    # TRL computes from logits / temperature over the completion mask).
    ((version, batch),) = cb.batches
    assert version == 0
    assert [v for v, _ in cb.consumed] == [0, 1]
    mb = cb.consumed[0][1]
    tokens, attn = mb.get(K("tokens")), mb.get(K("attention_mask"))
    with torch.no_grad():
        logits = initial(input_ids=tokens, attention_mask=attn.long()).logits
    ours = policy_metrics(mb, logits, temperature=0.7).values()
    assert math.isclose(ours["policy/entropy"], first["entropy"], rel_tol=1e-5), (
        ours["policy/entropy"],
        first["entropy"],
    )
    # The TorchRL loop's hooks over the same batches (the generation, stamped with version 0
    # and trained from version 0; the first micro-batch at the initial weights, old log-probs
    # recomputed by the trainer as TRL does): every name both log agrees at step 1.
    from posttrain.contracts.alignment import token_log_probs

    batch.set(K("policy_version"), torch.zeros(batch.batch_size[0], dtype=torch.long))
    acc = rollout_metrics(batch, learner_version=0)
    old = token_log_probs(logits / 0.7, tokens)
    policy_metrics(mb, logits, acc, old_log_probs=old, temperature=0.7, clip=(0.2, 0.2))
    torchrl_side = acc.values()
    shared = sorted(set(torchrl_side) & {k for k, v in p.items() if 1 in v})
    differ = {
        k: (p[k][1], torchrl_side[k])
        for k in shared
        if not math.isclose(p[k][1], torchrl_side[k], rel_tol=1e-5, abs_tol=1e-6)
    }
    assert not differ, differ
    assert len(shared) >= 17, shared


def test_torchrl_collector_staleness_is_zero_on_policy_and_the_lag_off_policy() -> None:
    """The documented wiring on TorchRL's LLMCollector: ``learner_version`` is the collector's
    ``policy_version`` (bumped by each ``update_policy_weights_`` after an optimizer step), the
    version the batch's step starts from. On-policy it reads 0 every step; a batch held two
    pushes in a queue reads 2. (The loop's step counter against a collector whose version never
    moves read 0, 1, 2, ... on an on-policy loop.)"""
    torch.manual_seed(0)
    policy = tiny_causal_lm()
    src = llm_collector(policy, [[5, 6, 7], [8, 9]], 12, max_new_tokens=2, adapted=True)
    on: list[float] = []
    off: list[float] = []
    queue = []
    for batch in src:
        on.append(
            rollout_metrics(batch, learner_version=src.policy_version).values()["staleness/max"]
        )
        queue.append(batch)
        if len(queue) > 2:
            vals = rollout_metrics(queue.pop(0), learner_version=src.policy_version).values()
            off.append(vals["staleness/mean"])
        with torch.no_grad():  # the optimizer step, then the weights go to the collector
            next(policy.parameters()).mul_(1.0)
        src.update_policy_weights_(policy.state_dict())
    src.shutdown()
    assert on == [0.0] * 12
    assert off == [2.0] * 10
