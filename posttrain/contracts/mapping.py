"""Where each LLM-layout field lives in TorchRL, TRL and NeMo-RL (one table, used by the docs)."""

from __future__ import annotations

# The column heads of FRAMEWORK_KEYS (the catalogue's framework ids are catalogue.FRAMEWORKS).
KEY_MAP_FRAMEWORKS = ("TorchRL 0.14", "TRL 1.16 GRPOTrainer", "NeMo-RL train_data")

# Sources: torchrl/envs/llm and torchrl/objectives/llm/grpo.py (default keys);
# trl/trainer/grpo_trainer.py `_generate_and_score_completions` output dict;
# nemo_rl/algorithms/grpo.py and nemo_rl/algorithms/loss/loss_functions.py (train_data keys).
FRAMEWORK_KEYS: dict[str, tuple[str, str, str]] = {
    "tokens": (
        "`('tokens', 'full')`",
        "`prompt_ids` (left-padded) then `completion_ids` (right-padded)",
        "`input_ids` (right-padded) with `input_lengths` (int32)",
    ),
    "attention_mask": (
        "`('masks', 'all_attention_mask')`",
        "`prompt_mask` then `completion_mask`",
        "derived: `arange(T) < input_lengths`",
    ),
    "assistant_mask": (
        "`('masks', 'all_assistant_mask')`",
        "`completion_mask` (prompt part False)",
        "`token_mask` (generated tokens) times `sample_mask` (per sequence)",
    ),
    "sample_log_probs": (
        "`('log_probs', 'full')` (NaN outside the mask)",
        "`old_per_token_logps` (completion positions only)",
        "`generation_logprobs` (0 outside the mask); `prev_logprobs` is the trainer's recomputation",
    ),
    "ref_log_probs": (
        "`('next', 'ref_log_probs', 'full')`",
        "`ref_per_token_logps` (completion positions only)",
        "`reference_policy_logprobs`",
    ),
    "advantage": ("`'advantage'`", "`advantages` [B]", "`advantages` [B, T]"),
    "reward": (
        "`('next', 'reward')`",
        "not in the batch (reduced to `advantages`)",
        "not in train_data (reduced to `advantages`)",
    ),
    "policy_version": (
        "`'policy_version'` (`track_policy_version=True`)",
        "none",
        "`weight_version` (async replay buffer)",
    ),
    "group_id": (
        "none (grouped by prompt in the advantage transform)",
        "implicit: `num_generations` consecutive rows",
        "implicit: identical prompt rows",
    ),
}

LOSS_COUNT_FRAMEWORKS = ("TorchRL 0.14", "TRL 1.16 GRPOTrainer", "NeMo-RL", "verl")

# Sources: torchrl/objectives/llm/grpo.py (GRPOLoss._aggregate_loss_value); trl GRPOTrainer
# _compute_loss (loss_type) and _generate_and_score_completions (num_items_in_batch);
# nemo_rl/algorithms/loss_functions.py (ClippedPGLossFn, masked_mean with
# global_normalization_factor) and the workers' all-reduced counts; verl
# trainer/ppo/core_algos.py agg_loss (batch_num_tokens, global_batch_size, dp_size,
# loss_scale_factor) and trainer/ppo/ray_trainer.py RayPPOTrainer._update_actor (what the
# trainer passes as global_batch_size), at verl 0.9.1.
LOSS_COUNT_KEYS: dict[str, tuple[str, str, str, str]] = {
    "tokens": (
        "none: `GRPOLoss` divides by its own micro-batch's `mask.sum()`",
        "`num_items_in_batch`: completion tokens of the generation batch gathered over "
        "processes; `loss_type` 'dapo'/'cispo' divide the local sum by `num_items_in_batch / "
        "num_processes x grad_accum_steps / steps_per_generation` (DDP then averages ranks); "
        "'bnpo' divides by the micro-batch's own tokens and by the accumulation steps",
        "`global_valid_toks`: sum of `token_mask[:, 1:] * sample_mask` over micro-batches and "
        "all-reduced over DP ranks; token-level losses divide the local sum by it",
        "`batch_num_tokens`: `response_mask` tokens of the global mini-batch; `agg_loss` "
        "'token-mean' divides the local sum by it times `dp_size` (FSDP averages ranks)",
    ),
    "sequences": (
        "none: `prompt_mean` averages the micro-batch's rows",
        "none: `loss_type='grpo'` takes `.mean()` over the micro-batch's rows, a row without "
        "completion tokens included, then divides by the accumulation steps; `dr_grpo` divides "
        "by rows x `max_completion_length`",
        "`global_valid_seqs`: sum of `sample_mask`, all-reduced; a sample with no valid token "
        "still counts (map: `sample_mask` = the row has an assistant token)",
        "`global_batch_size`: verl's trainer passes `ppo_mini_batch_size x rollout.n`, every "
        "row of the mini-batch, a row without response tokens included "
        "(`RayPPOTrainer._update_actor`); `agg_loss` counts rows with `response_mask.sum() > 0` "
        "(its `seq_mask`) only when the argument is None; 'seq-mean-*' divide by it times "
        "`dp_size`, and 'seq-mean-token-sum-norm' by `loss_scale_factor`, the tensor's width "
        "when unset",
    ),
}
"""Where each framework takes the global batch's counts a loss normalizes by (loss 1.3)."""
