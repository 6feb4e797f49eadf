"""TorchRL's deviations from the contracts, each with a minimal repro a maintainer can paste.

Each repro is a script in ``tests/torchrl_repros/`` (linted and type-checked with the tests):
plain TorchRL code ending in ``assert`` statements that hold *because of* the deviation.
``tests/adapters/torchrl/`` run them, so a fix upstream shows up there, and
``scripts/publish_torchrl_report.py`` prints each one under its deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPRO_DIR = Path(__file__).resolve().parents[3] / "tests" / "torchrl_repros"
"""Where the repro scripts lie: in a source checkout, beside the tests that run them."""


@dataclass(frozen=True)
class Deviation:
    """One way a TorchRL component breaks a requirement, with its repro script.

    Example:
        >>> DEVIATIONS[0].requirements, DEVIATIONS[0].path.name
        (('BUF-009',), 'buf_009_missing_key.py')
        >>> DEVIATIONS[0].source().splitlines()[0]
        '\"\"\"BUF-009: extend accepts a batch with a stored key missing.\"\"\"'
    """

    requirements: tuple[str, ...]
    component: str
    title: str
    repro_name: str
    """The repro script's file name in :data:`REPRO_DIR`, without ``.py``."""
    blocked_by: tuple[str, ...] = ()
    """Declared failures that block ``requirements`` in a full run of the row (run alone, they
    fail as the repro shows)."""

    @property
    def path(self) -> Path:
        """The repro script (present in a source checkout, not in an installed wheel)."""
        return REPRO_DIR / f"{self.repro_name}.py"

    def source(self) -> str:
        """The repro's code, as the published report shows it.

        Raises ``FileNotFoundError`` naming the script outside a source checkout.
        """
        return self.path.read_text()


DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("BUF-009",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage, LazyStackStorage",
        "extend accepts a batch with a stored key missing",
        "buf_009_missing_key",
    ),
    Deviation(
        ("BUF-010",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage, LazyStackStorage",
        "extend accepts a batch with a key the buffer does not store",
        "buf_010_extra_key",
    ),
    Deviation(
        ("BUF-011",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage",
        "a wrong dtype fails half-way: the error names no key and the write position still advances",
        "buf_011_wrong_dtype",
    ),
    Deviation(
        ("BUF-012",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage",
        "a wrong item shape fails half-way: the error names no key and the write position still advances",
        "buf_012_wrong_shape",
    ),
    Deviation(
        ("BUF-004",),
        "ReplayBuffer / SamplerWithoutReplacement",
        "sample(n) returns fewer than n items when the current epoch has fewer left",
        "buf_004_short_sample",
    ),
    Deviation(
        ("BUF-018",),
        "ReplayBuffer / LazyStackStorage (ListStorage)",
        "dumps refuses list-backed storages, so ragged buffers cannot be checkpointed with it",
        "buf_018_dumps_list_storage",
    ),
    Deviation(
        ("BUF-015",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage (local and Ray-served)",
        "an extend of 0 items into a buffer nothing was written to raises IndexError",
        "buf_015_empty_first_extend",
    ),
    Deviation(
        ("BUF-018",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage (local and Ray-served)",
        "dumps of a buffer nothing was written to raises 'Cannot save a non-initialized storage'",
        "buf_018_dumps_empty_storage",
    ),
    Deviation(
        ("BUF-006",),
        "ReplayBuffer / LazyStackStorage (ListStorage)",
        "extend keeps the caller's tensors (views of its rows): writing into the batch afterwards changes the stored items",
        "buf_006_keeps_caller_tensors",
    ),
    Deviation(
        ("BUF-014",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage",
        "state_dict() returns the live storage tensors: a snapshot changes with every later extend",
        "buf_014_live_state_dict",
    ),
    Deviation(
        ("BUF-024",),
        "ReplayBuffer.loads / LazyTensorStorage, LazyMemmapStorage (local and Ray-served)",
        "loads unpickles prefetch.pkl (a planted pickle runs its code) and, refusing a damaged file, leaves the storage already replaced",
        "buf_024_loads_unpickles",
        blocked_by=("BUF-018",),  # buffer 1.5: dumps of an empty buffer fails first
    ),
)
"""Known deviations of TorchRL 0.14.1's buffers, found by the buffer suite."""

LOSS_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("LOSS-008",),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "an unknown aggregation silently falls back to token_mean, and misspelt keyword arguments are swallowed by **kwargs",
        "loss_008_unknown_aggregation",
    ),
    Deviation(
        ("LOSS-001",),
        "GRPOLoss (and DAPO, CISPOLoss) with aggregation='prompt_mean'",
        "prompt_mean returns loss terms of shape [1] instead of scalars",
        "loss_001_prompt_mean_shape",
    ),
    Deviation(
        ("LOSS-005", "LOSS-012"),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "entropy, clip_fraction and kl_approx are averaged over every position of the padded batch, so padding and prompt length change them",
        "loss_005_padding_dilutes_diagnostics",
    ),
    Deviation(
        ("LOSS-009",),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "a mask of the wrong dtype is not refused by name: a float assistant mask fails on '~' naming no key, an int64 attention mask is accepted",
        "loss_009_mask_dtype",
    ),
    Deviation(
        ("LOSS-015",),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "an advantage of shape [B, 1] (TorchRL's [B, 1, 1]) is broadcast along the tokens instead of refused",
        "loss_015_advantage_b1",
    ),
    Deviation(
        ("LOSS-010",),
        "GRPOLoss (and DAPO, CISPOLoss) with kl_to_ref_coeff",
        "the KL to the reference is averaged over every position of the padded batch, so padding dilutes it",
        "loss_010_padding_dilutes_kl",
    ),
    Deviation(
        ("LOSS-023", "LOSS-021"),
        "CISPOLoss",
        "the surrogate is -A·clip(r) with the gradient through the clip, not CISPO's -A·sg(clip(r))·log pi: a token whose ratio is outside [1 - ε_low, 1 + ε_high] gets no gradient at all, and the loss value is not the weighted log-likelihood",
        "loss_023_cispo_clipped_weight_zero_gradient",
    ),
)
"""Known deviations of TorchRL 0.14.1's LLM losses, found by the loss suite."""

ROLLOUT_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("ROLL-001",),
        "TransformersWrapper(generate=True, pad_output=False)",
        "when the tokenizer's pad token is its EOS token (as in many real tokenizers), the EOS that ends a response is taken for padding (masks are tokens != pad_token_id) and dropped from the response and the masks",
        "roll_001_eos_taken_for_pad",
    ),
    Deviation(
        ("ROLL-002",),
        "TransformersWrapper(generate=True, input_mode='tokens')",
        "a prompt token equal to the tokenizer's pad id is dropped (the prompt's attention mask is tokens != pad_token_id): the model never sees it and the batch's prompt is not the one given",
        "roll_002_pad_id_prompt_tokens_dropped",
        blocked_by=("ROLL-001",),
    ),
    Deviation(
        ("ROLL-008",),
        "TransformersWrapper(generate=True, return_log_probs=True)",
        "the log-prob of the first generated token is set to 0 (_log_probs_generate: log_probs[:, 0] = 0)",
        "roll_008_first_log_prob_zero",
        blocked_by=("ROLL-001",),
    ),
    Deviation(
        ("ROLL-004",),
        "LLMCollector.update_policy_weights_",
        "a plain state dict (documented as accepted: 'dict: A regular dict containing weights') fails with AttributeError",
        "roll_004_plain_state_dict",
        blocked_by=("ROLL-001",),
    ),
    Deviation(
        ("ROLL-003", "ROLL-004"),
        "LLMCollector(track_policy_version=True)",
        "the root policy_version is stamped when the prompt is loaded, so a batch generated after an update still carries the old version (('next', 'policy_version') is right)",
        "roll_003_stale_policy_version",
        blocked_by=("ROLL-001",),
    ),
    Deviation(
        ("ROLL-007",),
        "LLMCollector.shutdown",
        "once its declared total is spent, a shut-down collector answers a new iteration (and an iterator taken before shutdown) with StopIteration, an empty iteration, instead of an error (without a total it raises AttributeError)",
        "roll_007_spent_collector_stops_silently",
    ),
)
"""Known deviations of TorchRL 0.14.1's LLMCollector and TransformersWrapper, found by the rollout suite."""

WEIGHT_SYNC_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("WS-004",),
        "VanillaWeightUpdater, SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme",
        "a wrong shape fails part-way: earlier tensors are already overwritten and the error names no parameter",
        "ws_004_half_written",
    ),
    Deviation(
        ("WS-005",),
        "VanillaWeightUpdater, SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme",
        "a tensor of the wrong dtype is cast silently",
        "ws_005_dtype_cast",
    ),
    Deviation(
        ("WS-006",),
        "VanillaWeightUpdater, SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme",
        "a missing name keeps the old tensor and an unknown name is ignored, both silently",
        "ws_006_missing_and_unknown_names",
    ),
    Deviation(
        ("WS-004",),
        "MultiProcessWeightSyncScheme (sync=True)",
        "after a wrong shape the receiver only logs the error and never acknowledges, so send() blocks forever",
        "ws_004_multiprocess_never_acks",
    ),
)
"""Known deviations of TorchRL 0.14.1's weight transports, found by the weight-sync suite."""

GENERATION_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("GEN-002",),
        "InferenceServer (thread backend)",
        "a future its caller cancelled while queued makes set_result raise InvalidStateError in the worker, which dies: every later request of every other caller fails ('InferenceServer is shutting down.') or is never answered",
        "gen_002_cancelled_future_stops_server",
    ),
    Deviation(
        ("GEN-005",),
        "InferenceServer (thread backend)",
        "update_policy_weights_ bumps the version without the model lock, and a batch is stamped when its forward ends: a batch in flight during an update is stamped with the new version",
        "gen_005_version_of_batch_in_flight",
    ),
    Deviation(
        ("GEN-006",),
        "InferenceServer (thread backend)",
        "update_policy_weights_(model_id, weights) bumps the version but loads nothing",
        "gen_006_update_loads_nothing",
    ),
    Deviation(
        ("GEN-007",),
        "InferenceServer (thread backend)",
        "a malformed request reaches the model and its error fails every request of the batch",
        "gen_007_bad_request_fails_batch",
    ),
    Deviation(
        ("GEN-009",),
        "InferenceServer (thread backend)",
        "a request submitted after shutdown() is never answered nor failed",
        "gen_009_submit_after_shutdown",
    ),
    Deviation(
        ("GEN-010",),
        "InferenceServer (thread backend)",
        "stats() reports p50/p95 milliseconds and avg_batch_size, not queue_wait_s/batch_size/forward_s",
        "gen_010_stats_names",
    ),
)
"""TorchRL's InferenceServer against the generation contract, with executable repros."""

RAY_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("BUF-009", "BUF-023"),
        'TensorDictReplayBuffer(service_backend="ray") (RayReplayBuffer)',
        "a producer's batch with a key missing is stored through a client, like the local buffer's",
        "ray_buf_009_client_missing_key",
    ),
    Deviation(
        ("WS-001",),
        "RayWeightSyncScheme, DistributedWeightSyncScheme (gloo)",
        "weights holding a non-contiguous tensor are refused by gloo's send ('input tensor has to be contiguous'), so a transposed or strided weight never reaches the receiver",
        "ray_ws_001_non_contiguous",
    ),
    Deviation(
        ("WS-004", "WS-005", "WS-006"),
        "RayWeightSyncScheme",
        "weights of the wrong size abort the receiving actor's process; same-size weights of another dtype are reinterpreted bit for bit and acknowledged",
        "ray_ws_004_wrong_size_and_dtype",
        blocked_by=("WS-001",),  # weight_sync 1.4 sends non-contiguous tensors first
    ),
)
"""Known deviations of TorchRL 0.14.1's Ray-served buffer and Ray weight-sync scheme."""

LOGGER_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("MET-002",),
        "WandbLogger",
        'a metric named "step" or "<group>/step" is taken for a step counter: its value becomes the step of its group and its own step is lost',
        "met_002_wandb_step_metric",
    ),
    Deviation(
        ("MET-007",),
        "CSVLogger",
        "a value logged without a step goes to the count of the name's values so far, not one past its highest step: after step 5 it lands at step 1, back in time",
        "met_007_csv_no_step",
    ),
    Deviation(
        ("MET-007",),
        "TensorboardLogger",
        "every value logged without a step is stored at step 0 (SummaryWriter's default)",
        "met_007_tensorboard_no_step",
    ),
)
"""Known deviations of TorchRL 0.14.1's loggers (run in a fresh interpreter: W&B is per process)."""
