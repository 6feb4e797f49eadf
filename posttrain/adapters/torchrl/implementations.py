"""TorchRL's own buffers as conformance targets: raw, and through the adapter.

Each ``Implementation`` here is registered under the ``posttrain.implementations`` entry-point
group so ``make report`` shows TorchRL's rows. Factories import TorchRL lazily.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from posttrain.adapters.torchrl.buffer import ValidatedReplayBuffer
from posttrain.adapters.torchrl.dist_weight_sync import dist_weight_sync_pair
from posttrain.adapters.torchrl.generation import inference_server
from posttrain.adapters.torchrl.loggers import (
    csv_logger,
    read_tensorboard,
    read_torchrl_csv,
    read_torchrl_wandb,
    tensorboard_logger,
    wandb_logger,
)
from posttrain.adapters.torchrl.loss import RATIOS, make_loss
from posttrain.adapters.torchrl.ray_weight_sync import ray_weight_sync_pair
from posttrain.adapters.torchrl.rollout import llm_collector
from posttrain.adapters.torchrl.weight_sync import TRANSPORTS, weight_sync_pair
from posttrain.contracts.implementation import Implementation


def _torchrl() -> Any:
    try:
        import torchrl.data as data
    except ImportError as e:  # pragma: no cover - only without the extra
        raise ImportError(
            "the TorchRL adapters need torchrl: pip install 'posttrain[torchrl]'"
        ) from e
    return data


def prioritized_unavailable() -> str | None:
    """Why TorchRL's prioritized sampler cannot run here (its C++ extension), or None.

    Example:
        >>> reason = prioritized_unavailable()
        >>> reason is None or "C++" in reason
        True
    """
    data = _torchrl()
    try:
        data.PrioritizedSampler(2, alpha=1.0, beta=1.0)
    except RuntimeError as e:
        return f"torchrl's C++ extension did not load against this torch ({e})"
    return None


def _storage(kind: str, capacity: int) -> Any:
    data = _torchrl()
    if kind == "tensor":
        return data.LazyTensorStorage(capacity)
    if kind == "memmap":
        scratch = tempfile.mkdtemp(prefix="posttrain-memmap-")
        storage = data.LazyMemmapStorage(capacity, scratch_dir=scratch)
        # The files go with the storage (and at exit): a report makes thousands of these buffers.
        weakref.finalize(storage, shutil.rmtree, scratch, ignore_errors=True)
        return storage
    return data.LazyStackStorage(capacity)


def _factory(
    kind: str, *, without_replacement: bool = False, adapted: bool = False
) -> Callable[[int], Any]:
    def make(capacity: int) -> Any:
        data = _torchrl()
        sampler = data.SamplerWithoutReplacement() if without_replacement else data.RandomSampler()
        rb = data.TensorDictReplayBuffer(storage=_storage(kind, capacity), sampler=sampler)
        return ValidatedReplayBuffer(rb, ragged=kind == "stack") if adapted else rb

    make.__name__ = f"{'adapted' if adapted else 'raw'}_{kind}"
    return make


# What TorchRL 0.14.1's raw components fail, each with a repro in deviations.py (published in
# docs/reports/): a raw row failing anything else, or no longer failing one of these, makes
# `make report` fail.
_ATOMICITY = frozenset({"BUF-009", "BUF-010", "BUF-011", "BUF-012"})
_RAW_LOSS_TOKEN_MEAN = frozenset({"LOSS-005", "LOSS-008", "LOSS-009", "LOSS-012", "LOSS-015"})
_RAW_LOSS_PROMPT_MEAN = frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"})
# CISPOLoss: -A·clip(r), not -A·sg(clip(r))·log pi (deviations.py, loss_023 repro).
_RAW_CISPO = frozenset({"LOSS-021", "LOSS-023"})
_RAW_WEIGHT_SYNC = frozenset({"WS-004", "WS-005", "WS-006"})


def _impl(
    kind: str, label: str, *, adapted: bool, without_replacement: bool = False
) -> Implementation:
    caps = {"checkpoint", "thread_safe"} | ({"ragged"} if kind == "stack" else set())
    if adapted:  # raw TorchRL indexes its storage (rb[i]) but has no read() with range checks
        caps |= {"read"}
    wrapper = "ValidatedReplayBuffer(" if adapted else ""
    sampler = "SamplerWithoutReplacement" if without_replacement else "RandomSampler"
    return Implementation(
        "buffer",
        _factory(kind, without_replacement=without_replacement, adapted=adapted),
        name=f"{wrapper}TensorDictReplayBuffer({label}, {sampler}){')' if adapted else ''}",
        capabilities=caps,
        options={"sampling": "without_replacement" if without_replacement else "with_replacement"},
        unavailable={
            "priority": "PrioritizedSampler needs torchrl's C++ extension (see prioritized_unavailable())"
        },
        known_failures=frozenset()
        if adapted
        else _ATOMICITY
        | ({"BUF-004"} if without_replacement else set())  # sample(n) returns the epoch's rest
        # ListStorage refuses dumps/loads; buffer 1.5: tensor storages refuse to dump when empty
        # (which blocks BUF-024, loads unpickling prefetch.pkl, and BUF-025 in a full run)
        | {"BUF-018"}
        # buffer 1.3: ListStorage keeps the caller's rows; tensor storages' state_dict is live
        # (buffer 1.5: and they refuse an extend of 0 items into an empty buffer)
        | ({"BUF-006"} if kind == "stack" else {"BUF-014", "BUF-015"}),
    )


def _ray_served(capacity: int, *, adapted: bool) -> Any:
    """TorchRL's own Ray service (``RayReplayBuffer`` around a ``TensorDictReplayBuffer``).

    Every call hands out a new, empty buffer that nothing else holds, in the Ray rows' shared
    host actor (``posttrain.adapters.ray.hosted``) rather than an actor process of its own: a
    process spends 2-3 s importing torch and torchrl before its first answer, and the suite
    makes a fresh buffer for every check (~40). TorchRL's client code is unchanged.
    """
    from posttrain.adapters.ray.hosted import hosted_torchrl_buffer
    from posttrain.adapters.ray.implementations import shared_host

    data = _torchrl()
    rb = hosted_torchrl_buffer(
        data.TensorDictReplayBuffer,
        shared_host(),
        storage=partial(data.LazyTensorStorage, capacity),
        sampler=data.RandomSampler,
    )
    return ValidatedReplayBuffer(rb) if adapted else rb


def _ray_impl(*, adapted: bool) -> Implementation:
    make = partial(_ray_served, adapted=adapted)
    caps = {"checkpoint", "thread_safe", "remote_writers"} | ({"read"} if adapted else set())
    inner = 'TensorDictReplayBuffer(LazyTensorStorage, RandomSampler, service_backend="ray")'
    return Implementation(
        "buffer",
        make,
        name=f"ValidatedReplayBuffer({inner})" if adapted else inner,
        capabilities=caps,
        unavailable={
            "priority": "PrioritizedSampler needs torchrl's C++ extension (see prioritized_unavailable())"
        },
        description="TorchRL's Ray-served replay buffer (RayReplayBuffer; each buffer new, in one "
        "shared host actor; local Ray cluster)"
        + (", checked by the adapter in each client" if adapted else ""),
        # buffer 1.4: its loads is TorchRL's (prefetch.pkl unpickled, storage replaced first)
        # buffer 1.5: an empty buffer refuses an extend of 0 items and a dumps (which blocks
        # BUF-024, loads unpickling prefetch.pkl, and BUF-025 in a full run)
        # buffer 1.6, adapted: the served storage lives in the host actor, so its state comes
        # back as TorchRL joins it (nested names with '.'): a column named 'a.b' beside
        # ('a', 'b') cannot be told apart, and the adapter refuses that state on loads
        known_failures=frozenset({"BUF-018"})
        if adapted
        else _ATOMICITY | {"BUF-015", "BUF-018", "BUF-023"},
    )


RAW_RAY_LAZY_TENSOR = _ray_impl(adapted=False)
ADAPTED_RAY_LAZY_TENSOR = _ray_impl(adapted=True)
RAW_LAZY_TENSOR = _impl("tensor", "LazyTensorStorage", adapted=False)
RAW_LAZY_TENSOR_NO_REPLACEMENT = _impl(
    "tensor", "LazyTensorStorage", adapted=False, without_replacement=True
)
RAW_LAZY_MEMMAP = _impl("memmap", "LazyMemmapStorage", adapted=False)
RAW_LAZY_STACK = _impl("stack", "LazyStackStorage", adapted=False)
ADAPTED_LAZY_TENSOR = _impl("tensor", "LazyTensorStorage", adapted=True)
ADAPTED_LAZY_TENSOR_NO_REPLACEMENT = _impl(
    "tensor", "LazyTensorStorage", adapted=True, without_replacement=True
)
ADAPTED_LAZY_MEMMAP = _impl("memmap", "LazyMemmapStorage", adapted=True)
ADAPTED_LAZY_STACK = _impl("stack", "LazyStackStorage", adapted=True)


CSV_LOGGER = Implementation(
    "metrics",
    csv_logger,
    name="torchrl.CSVLogger",
    capabilities={"flush", "cross_process"},
    extras={"reader": read_torchrl_csv, "precision": "float64"},  # repr() of a Python float
    known_failures={"MET-007"},  # no step: the count of the name's values, not its next step
    description="TorchRL's CSVLogger, read back from its scalars/<name>.csv files.",
)
TENSORBOARD_LOGGER = Implementation(
    "metrics",
    tensorboard_logger,
    name="torchrl.TensorboardLogger",
    capabilities={"flush", "cross_process"},
    extras={"reader": read_tensorboard},
    known_failures={"MET-007"},  # no step: every such value at step 0
    description="TorchRL's TensorboardLogger, read back with TensorBoard's EventAccumulator.",
)
WANDB_LOGGER = Implementation(
    "metrics",
    wandb_logger,
    name="torchrl.WandbLogger (offline)",
    extras={"reader": read_torchrl_wandb, "precision": "float64"},
    known_failures={"MET-002"},  # a metric named step or <group>/step becomes a step counter
    description=(
        "TorchRL's WandbLogger in offline mode, read back from the run's .wandb log with W&B's "
        "own reader, each name at its TorchRL step column."
    ),
)


_KL_COEFF = 0.1
_DAPO_CLIP = (0.2, 0.28)


def _loss(cls_name: str, aggregation: str, *, adapted: bool, kl: bool = False) -> Implementation:
    torchrl_name = {"token_mean": "token_mean", "seq_mean_token_mean": "prompt_mean"}[aggregation]
    wrapper = "ContractLoss(" if adapted else ""
    extra: dict[str, Any] = {"kl_to_ref_coeff": _KL_COEFF} if kl else {}
    shown = f", kl_to_ref_coeff={_KL_COEFF}" if kl else ""
    # GRPOLoss and DAPO clip PPO-style (GRPOLoss's default 0.2; DAPO with its paper's
    # clip-higher pair). CISPOLoss weights by the clipped ratio instead (ratio 'cispo'), at the
    # bounds it inherits: GRPOLoss.__init__'s clip_epsilon=0.2, which
    # CISPOLoss._compute_policy_objective applies as log_weight.clamp(*self._clip_bounds),
    # GRPOLoss._clip_bounds = (log1p(-0.2), log1p(0.2)): r within [0.8, 1.2]
    # (torchrl/objectives/llm/grpo.py).
    clips: dict[str, float | tuple[float, float]] = {
        "GRPOLoss": 0.2,
        "DAPO": _DAPO_CLIP,
        "CISPOLoss": 0.2,
    }
    clip = clips.get(cls_name)
    cispo = cls_name == "CISPOLoss"
    if cls_name == "DAPO":
        extra["clip_epsilon"] = _DAPO_CLIP
        shown += f", clip_epsilon={_DAPO_CLIP}"
    return Implementation(
        "loss",
        partial(make_loss(cls_name, adapted=adapted), aggregation=aggregation, **extra),
        name=f"{wrapper}{cls_name}(TransformersWrapper, aggregation={torchrl_name!r}{shown}){')' if adapted else ''}",
        capabilities={"diagnostics"}
        | ({"global_counts"} if adapted else set())
        | ({"kl_to_ref"} if kl else set())
        | ({"clip"} if clip is not None else set()),
        # The ratio each class's surrogate takes (loss.RATIOS), declared so LOSS-021 checks it.
        options={"aggregation": aggregation, "ratio": RATIOS[cls_name]},
        extras={} if clip is None else {"clip_epsilon": clip},
        description="TorchRL LLM loss around a TransformersWrapper of the suite's policy (masking_strategy='rlhf')."
        + ("" if adapted else " Raw: only the advantage is reshaped to TorchRL's [B, T, 1].")
        + (
            " The adapter computes CISPO's surrogate -A·sg(clip(r))·log pi in place of "
            "CISPOLoss's -A·clip(r)."
            if adapted and cispo
            else ""
        ),
        known_failures=frozenset()
        if adapted
        else (
            _RAW_LOSS_PROMPT_MEAN if aggregation == "seq_mean_token_mean" else _RAW_LOSS_TOKEN_MEAN
        )
        | ({"LOSS-010"} if kl else set())
        | (_RAW_CISPO if cispo else set()),
    )


RAW_GRPOLOSS_TOKEN_MEAN = _loss("GRPOLoss", "token_mean", adapted=False)
ADAPTED_GRPOLOSS_TOKEN_MEAN = _loss("GRPOLoss", "token_mean", adapted=True)
RAW_GRPOLOSS_SEQ_MEAN_TOKEN_MEAN = _loss("GRPOLoss", "seq_mean_token_mean", adapted=False)
ADAPTED_GRPOLOSS_SEQ_MEAN_TOKEN_MEAN = _loss("GRPOLoss", "seq_mean_token_mean", adapted=True)
RAW_DAPO_TOKEN_MEAN = _loss("DAPO", "token_mean", adapted=False)
ADAPTED_DAPO_TOKEN_MEAN = _loss("DAPO", "token_mean", adapted=True)
RAW_DAPO_SEQ_MEAN_TOKEN_MEAN = _loss("DAPO", "seq_mean_token_mean", adapted=False)
ADAPTED_DAPO_SEQ_MEAN_TOKEN_MEAN = _loss("DAPO", "seq_mean_token_mean", adapted=True)
RAW_CISPOLOSS_TOKEN_MEAN = _loss("CISPOLoss", "token_mean", adapted=False)
ADAPTED_CISPOLOSS_TOKEN_MEAN = _loss("CISPOLoss", "token_mean", adapted=True)
RAW_CISPOLOSS_SEQ_MEAN_TOKEN_MEAN = _loss("CISPOLoss", "seq_mean_token_mean", adapted=False)
ADAPTED_CISPOLOSS_SEQ_MEAN_TOKEN_MEAN = _loss("CISPOLoss", "seq_mean_token_mean", adapted=True)
RAW_GRPOLOSS_TOKEN_MEAN_KL = _loss("GRPOLoss", "token_mean", adapted=False, kl=True)
ADAPTED_GRPOLOSS_TOKEN_MEAN_KL = _loss("GRPOLoss", "token_mean", adapted=True, kl=True)
LOSSES: dict[str, Implementation] = {
    "torchrl-raw-grpoloss-token-mean": RAW_GRPOLOSS_TOKEN_MEAN,
    "torchrl-adapted-grpoloss-token-mean": ADAPTED_GRPOLOSS_TOKEN_MEAN,
    "torchrl-raw-grpoloss-seq-mean-token-mean": RAW_GRPOLOSS_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-adapted-grpoloss-seq-mean-token-mean": ADAPTED_GRPOLOSS_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-raw-dapo-token-mean": RAW_DAPO_TOKEN_MEAN,
    "torchrl-adapted-dapo-token-mean": ADAPTED_DAPO_TOKEN_MEAN,
    "torchrl-raw-dapo-seq-mean-token-mean": RAW_DAPO_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-adapted-dapo-seq-mean-token-mean": ADAPTED_DAPO_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-raw-cispoloss-token-mean": RAW_CISPOLOSS_TOKEN_MEAN,
    "torchrl-adapted-cispoloss-token-mean": ADAPTED_CISPOLOSS_TOKEN_MEAN,
    "torchrl-raw-cispoloss-seq-mean-token-mean": RAW_CISPOLOSS_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-adapted-cispoloss-seq-mean-token-mean": ADAPTED_CISPOLOSS_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-raw-grpoloss-token-mean-kl": RAW_GRPOLOSS_TOKEN_MEAN_KL,
    "torchrl-adapted-grpoloss-token-mean-kl": ADAPTED_GRPOLOSS_TOKEN_MEAN_KL,
}
"""TorchRL's LLM losses, raw and adapted, in each aggregation they offer, by entry-point name."""


def _collector(*, adapted: bool) -> Implementation:
    return Implementation(
        "rollout",
        partial(llm_collector, adapted=adapted),
        name=("ContractCollector(" if adapted else "")
        + "LLMCollector(TransformersWrapper, track_policy_version=True)"
        + (")" if adapted else ""),
        capabilities={"ragged", "log_probs"},
        description="One ChatEnv subclass feeds token-id prompts (TorchRL has no such env); "
        + (
            "the adapter pads prompts with an id outside the vocabulary (a prompt token equal to "
            "the pad id is kept), stamps ('next', 'policy_version'), checks and converts state "
            "dicts, rescores log-probs with a non-generating TransformersWrapper, refuses after "
            "shutdown."
            if adapted
            else "raw: keys mapped to the layout, TorchRL's own values and weight path."
        ),
        # raw: the dropped EOS fails ROLL-001, which blocks the ROLL-002/003/004/008 checks
        # (their deviations keep their repros); a spent, shut-down collector stops silently
        known_failures=set() if adapted else {"ROLL-001", "ROLL-007"},
    )


RAW_LLM_COLLECTOR = _collector(adapted=False)
ADAPTED_LLM_COLLECTOR = _collector(adapted=True)


def _weight_sync(transport: str, *, adapted: bool) -> Implementation:
    cls = TRANSPORTS[transport]
    return Implementation(
        "weight_sync",
        partial(weight_sync_pair, transport=transport, adapted=adapted),
        name=("CheckedSender(" if adapted else "") + f"{cls}" + (")" if adapted else ""),
        # TorchRL writes into the receiver's model before send returns; receive() adopts the
        # version (the suite's model equals the sent weights right after send, 40 of 40 sends).
        capabilities={"applies_on_send"},
        description="Both ends in this process (the receiving end as a collector worker holds it); "
        + (
            "the adapter checks names, shapes and dtypes before TorchRL writes."
            if adapted
            else "raw: a state dict is passed to TorchRL as the nested TensorDict it takes, the version kept beside it."
        ),
        known_failures=frozenset() if adapted else _RAW_WEIGHT_SYNC,
    )


RAW_SHARED_MEM = _weight_sync("shared_mem", adapted=False)
ADAPTED_SHARED_MEM = _weight_sync("shared_mem", adapted=True)
RAW_MULTIPROCESS = _weight_sync("multiprocess", adapted=False)
ADAPTED_MULTIPROCESS = _weight_sync("multiprocess", adapted=True)
RAW_VANILLA = _weight_sync("vanilla", adapted=False)
ADAPTED_VANILLA = _weight_sync("vanilla", adapted=True)
WEIGHT_SYNCS: dict[str, Implementation] = {
    "torchrl-raw-shared-mem": RAW_SHARED_MEM,
    "torchrl-adapted-shared-mem": ADAPTED_SHARED_MEM,
    "torchrl-raw-multiprocess": RAW_MULTIPROCESS,
    "torchrl-adapted-multiprocess": ADAPTED_MULTIPROCESS,
    "torchrl-raw-vanilla": RAW_VANILLA,
    "torchrl-adapted-vanilla": ADAPTED_VANILLA,
}
"""TorchRL's weight transports, raw and adapted, by entry-point name."""


def _cross_process_weight_sync(
    make_pair: Callable[..., Any], scheme: str, where: str, raw: str, *, adapted: bool
) -> Implementation:
    return Implementation(
        "weight_sync",
        partial(make_pair, adapted=adapted),
        name=f"CheckedSender({scheme})" if adapted else scheme,
        # The receiving end applies each send before acknowledging it; receive() adopts the
        # version.
        capabilities={"cross_process", "applies_on_send"},
        description=where
        + (
            "the adapter checks names, shapes and dtypes before TorchRL sends."
            if adapted
            else "raw: the state dict plus the receiver's non-persistent buffers as the "
            "TensorDict the scheme takes" + raw
        ),
        # weight_sync 1.4: gloo refuses non-contiguous tensors (WS-001), which blocks the
        # wrong-weight requirements (WS-004/5/6: the receiving process aborts) in a full run
        known_failures=frozenset() if adapted else frozenset({"WS-001"}),
    )


_DIST = (
    dist_weight_sync_pair,
    'DistributedWeightSyncScheme(backend="gloo")',
    "The receiving model in its own process on torch.distributed's default group (gloo, "
    "loopback); the version kept beside the transport, reported once the receiver "
    "acknowledged; ",
    ".",
)
_RAY = (
    partial(ray_weight_sync_pair, start_next=True),  # the suite makes a pair per check
    "RayWeightSyncScheme",
    "The receiving model in a Ray actor, weights over gloo (local Ray cluster); ",
    ", the version through its model_version.",
)
RAW_DIST_WEIGHT_SYNC = _cross_process_weight_sync(*_DIST, adapted=False)
ADAPTED_DIST_WEIGHT_SYNC = _cross_process_weight_sync(*_DIST, adapted=True)
RAW_RAY_WEIGHT_SYNC = _cross_process_weight_sync(*_RAY, adapted=False)
ADAPTED_RAY_WEIGHT_SYNC = _cross_process_weight_sync(*_RAY, adapted=True)


def _inference_server(*, adapted: bool) -> Implementation:
    factory = partial(inference_server, adapted=adapted)
    return Implementation(
        "generation",
        factory,
        name=f"{'ContractInferenceServer(' if adapted else ''}InferenceServer(GenerateBatch, "
        f"thread){')' if adapted else ''}",
        options={"on_shutdown": "fail"},
        description="TorchRL's thread InferenceServer batching greedy HF generation (GenerateBatch)"
        + (": bad requests refused at submit, weights loaded through update_model, pending "
           "futures failed at shutdown, contract stats" if adapted else ", as TorchRL ships it"),
        known_failures=set() if adapted else {"GEN-002", "GEN-005", "GEN-006", "GEN-007", "GEN-009", "GEN-010"},
    )  # fmt: skip


ADAPTED_INFERENCE_SERVER_MP = Implementation(
    "generation",
    partial(inference_server, adapted=True, processes=True),
    name="ContractInferenceServer(InferenceServer(GenerateBatch, thread, MPTransport))",
    capabilities={"processes"},
    options={"on_shutdown": "fail"},
    description="The adapted InferenceServer over TorchRL's multiprocessing transport: clients "
    "handed to spawned processes.",
)
"""Entry point ``torchrl-adapted-inference-server-mp``."""
RAW_INFERENCE_SERVER = _inference_server(adapted=False)
"""Entry point ``torchrl-raw-inference-server``."""
ADAPTED_INFERENCE_SERVER = _inference_server(adapted=True)
"""Entry point ``torchrl-adapted-inference-server``."""
