"""The NeMo-RL adapters' conformance declarations (entry points in ``pyproject.toml``)."""

from __future__ import annotations

from functools import partial
from typing import Any

from posttrain.adapters.nemo_rl.loss import nemo_loss_module
from posttrain.contracts.implementation import Implementation


def _loss(aggregation: str) -> Implementation:
    return Implementation(
        "loss",
        partial(nemo_loss_module, aggregation=aggregation),
        name=f"NeMo-RL LossFunction both ways [{aggregation}]",
        # NeMo-RL's LossFunction returns one scalar with its KL term inside: no separate
        # loss_kl_to_ref to check (tests/adapters/nemo_rl/test_loss.py checks the KL through the total).
        capabilities={"per_token_advantage", "ragged", "clip", "global_counts"},
        options={"aggregation": aggregation},
        extras={"clip_epsilon": 0.2},  # PolicyLoss's default, NeMo-RL's ratio_clip
        description="posttrain's PolicyLoss (NeMo-RL's default clip and k3 KL) wrapped "
        "as a NeMo-RL LossFunction (ContractAsNemoLoss), wrapped back as a LossModuleV1 "
        "(NemoLossModule): both directions and the global-count normalization under test.",
    )


LOSS_TOKEN_MEAN = _loss("token_mean")
"""Entry point ``nemo-rl-loss-token-mean`` (NeMo-RL ``token_level``)."""
LOSS_SEQ_MEAN_TOKEN_MEAN = _loss("seq_mean_token_mean")
"""Entry point ``nemo-rl-loss-seq-mean-token-mean`` (NeMo-RL ``sequence_level``)."""


def _jsonl_logger(directory: Any) -> Any:
    from posttrain.adapters.nemo_rl.logger import NemoLogger
    from posttrain.reference_impls import JsonlSink

    return NemoLogger(JsonlSink(directory))


def _read_jsonl(directory: Any) -> Any:
    from posttrain.reference_impls import read_jsonl

    return read_jsonl(directory)


LOGGER_JSONL = Implementation(
    "metrics",
    _jsonl_logger,
    name="NemoLogger(JsonlSink)",
    capabilities={"flush", "cross_process"},
    extras={"reader": _read_jsonl, "precision": "float64"},  # JSON numbers, read back exactly
    description="NeMo-RL's LoggerInterface shape over posttrain's JSONL sink.",
)
"""Entry point ``nemo-rl-logger-jsonl``."""


def _sharded_weight_sync(model: Any) -> Any:
    from posttrain.adapters.nemo_rl.weight_sync import sharded_weight_sync

    return sharded_weight_sync(model, 3)


WEIGHT_SYNC_SHARDED = Implementation(
    "weight_sync",
    _sharded_weight_sync,
    name="NeMo-RL sharded senders (3 workers) -> posttrain receiver",
    description="Each of 3 policy workers sends its shard of the state dict (ShardSender); "
    "ShardAssembler hands a version to posttrain's in-process receiver once every shard of it "
    "arrived.",
)
"""Entry point ``nemo-rl-sharded-weight-sync``: conforms to the weight-sync suite."""
