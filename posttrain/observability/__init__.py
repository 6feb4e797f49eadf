"""Observability: the metric catalogue's hooks and reductions, usable from any loop.

Example:
    >>> from posttrain.observability import Accumulator, rollout_metrics
    >>> from posttrain.testing import llm_batch
    >>> "rollout/reward/mean" in rollout_metrics(llm_batch(2)).values()
    True
"""

from posttrain.observability.hook_compare import compare_policy_hook
from posttrain.observability.hooks import (
    Timers,
    buffer_metrics,
    generation_server_metrics,
    loss_metrics,
    optim_metrics,
    policy_metrics,
    reward_model_metrics,
    rollout_metrics,
    selection_metrics,
)
from posttrain.observability.reduce import Accumulator
from posttrain.observability.sinks import MlflowSink, WandbSink

__all__ = [
    "Accumulator",
    "MlflowSink",
    "Timers",
    "WandbSink",
    "buffer_metrics",
    "compare_policy_hook",
    "generation_server_metrics",
    "loss_metrics",
    "optim_metrics",
    "policy_metrics",
    "reward_model_metrics",
    "rollout_metrics",
    "selection_metrics",
]
