"""Small, obviously-correct implementations of every contract.

Example:
    >>> from posttrain.reference_impls import RingBuffer
    >>> len(RingBuffer(capacity=8))
    0
"""

from functools import partial

from posttrain.contracts import Implementation
from posttrain.reference_impls.dpo_loss import DPOLoss
from posttrain.reference_impls.generation_server import ThreadGenerationServer
from posttrain.reference_impls.hf_rollout import HFRolloutSource
from posttrain.reference_impls.jsonl_sink import (
    JsonlSink,
    read_jsonl,
    read_jsonl_histograms,
    read_jsonl_samples,
)
from posttrain.reference_impls.nll_loss import NLLLoss
from posttrain.reference_impls.pg_loss import PolicyGradientLoss
from posttrain.reference_impls.ring_buffer import RingBuffer
from posttrain.reference_impls.weight_sync import (
    InProcessReceiver,
    InProcessSender,
    in_process_weight_sync,
)

__all__ = [
    "DPOLoss",
    "HFRolloutSource",
    "InProcessReceiver",
    "InProcessSender",
    "JsonlSink",
    "NLLLoss",
    "PolicyGradientLoss",
    "RingBuffer",
    "ThreadGenerationServer",
    "in_process_weight_sync",
    "read_jsonl",
]
# The entry points' declarations (RING_BUFFER, PG_LOSS_*, HF_ROLLOUT, ...) below are module
# attributes that pyproject.toml's entry points and `--conformance-impl` name, not API.


def make_ring_buffer(capacity: int) -> RingBuffer:
    """The buffer factory the conformance suite calls: ``factory(capacity)``.

    Example:
        >>> make_ring_buffer(4).capacity
        4
    """
    return RingBuffer(capacity)


RING_BUFFER = Implementation(
    "buffer",
    make_ring_buffer,
    name="posttrain.RingBuffer",
    capabilities={"checkpoint", "thread_safe", "read"},
    description="Reference FIFO ring buffer over one preallocated row-packed byte matrix.",
)
"""The reference buffer's declaration (entry point ``reference-buffer``)."""


_CLIP = (0.2, 0.28)  # DAPO's clip-higher: asymmetric, so the suite tells the two bounds apart


def _pg_loss(aggregation: str) -> Implementation:
    return Implementation(
        "loss",
        partial(
            PolicyGradientLoss,
            aggregation=aggregation,
            clip_epsilon=_CLIP,
            kl_coef=0.05,
            entropy_coef=0.01,
            t_norm=16,
        ),
        name=f"posttrain.PolicyGradientLoss[{aggregation}]",
        capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "clip", "global_counts"},
        options={"aggregation": aggregation},
        extras={"t_norm": 16, "clip_epsilon": _CLIP},
        description="Reference clipped policy-gradient loss with k3 KL to reference and entropy.",
    )


PG_LOSS_TOKEN_MEAN = _pg_loss("token_mean")
PG_LOSS_SEQ_MEAN_TOKEN_MEAN = _pg_loss("seq_mean_token_mean")
PG_LOSS_SEQ_MEAN_TOKEN_SUM = _pg_loss("seq_mean_token_sum")
PG_LOSS_SEQ_MEAN_TOKEN_SUM_NORM = _pg_loss("seq_mean_token_sum_norm")
PG_LOSSES: dict[str, Implementation] = {
    i.resolved_options()["aggregation"]: i
    for i in (
        PG_LOSS_TOKEN_MEAN,
        PG_LOSS_SEQ_MEAN_TOKEN_MEAN,
        PG_LOSS_SEQ_MEAN_TOKEN_SUM,
        PG_LOSS_SEQ_MEAN_TOKEN_SUM_NORM,
    )
}
"""The reference loss in each aggregation (entry points ``reference-loss-<aggregation>``)."""


IN_PROCESS_WEIGHT_SYNC = Implementation(
    "weight_sync",
    in_process_weight_sync,
    name="posttrain.in_process_weight_sync",
    description="Reference in-process weight sync: check names, layouts, shapes, dtypes and the version, then copy.",
)
"""The reference weight sync's declaration (entry point ``reference-weight-sync``)."""

JSONL_SINK = Implementation(
    "metrics",
    JsonlSink,
    name="posttrain.JsonlSink",
    capabilities={"flush", "cross_process", "histogram", "samples"},
    extras={
        "reader": read_jsonl,
        "histogram_reader": read_jsonl_histograms,
        "samples_reader": read_jsonl_samples,
        "precision": "float64",  # JSON keeps every float64 (repr round-trips)
    },
    description="Reference JSONL metrics sink, read back with read_jsonl (histograms and samples in files of their own).",
)
"""The reference metrics sink's declaration (entry point ``reference-metrics-jsonl``)."""


HF_ROLLOUT = Implementation(
    "rollout",
    partial(HFRolloutSource, num_samples=2),
    name="posttrain.HFRolloutSource",
    capabilities={"log_probs", "groups"},
    description="Reference in-process rollout source over Hugging Face generate (2 samples per prompt).",
)
"""The reference rollout source's declaration (entry point ``reference-rollout-hf``)."""


GENERATION_SERVER = Implementation(
    "generation",
    ThreadGenerationServer,
    name="posttrain.ThreadGenerationServer",
    options={"on_shutdown": "fail"},
    description="Reference generation server: one worker thread batching requests over HF generate (greedy).",
)
"""The reference generation server's declaration (entry point ``reference-generation``)."""
