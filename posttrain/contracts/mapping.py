"""Where each LLM-layout field lives in TorchRL, TRL and NeMo-RL (one table, used by the docs)."""

from __future__ import annotations

__all__ = ["FRAMEWORKS", "FRAMEWORK_KEYS"]

FRAMEWORKS = ("TorchRL 0.14", "TRL 1.16 GRPOTrainer", "NeMo-RL train_data")

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
