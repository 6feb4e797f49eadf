"""The metric catalogue v1: every post-training metric with name, unit, reduction and formula.

A metric's *reduction* says how values from microbatches and steps combine, always from
global (numerator, denominator) pairs, never as a mean of means:

- ``tok``: sum over masked tokens / count of masked tokens;
- ``seq``: sum over sequences / count of sequences;
- ``sum``: sum; ``min`` / ``max``: extremum (a NaN anywhere makes it NaN); ``last``: the latest;
- ``rate``: sum of a quantity / sum of seconds;
- ``hist``: a distribution, the per-sequence values themselves (every micro-batch's and
  rank's values, concatenated: exact, no binning before the sink), written through a sink's
  ``log_histogram`` (metrics contract MET-008), never as a scalar.

Its *ranks* rule says how ranks combine (``Accumulator.all_reduce``): ``pairs`` (sum the
numerators and the counts: a count-weighted mean), ``moments`` (merge (count, mean, M2) in
float64: standard deviations and effective sample sizes), ``sum`` (counts, loss shares),
``max`` (wall times: ranks run at once; and maxima), ``min``, ``rate`` (the ranks' quantities
summed over the slowest rank's seconds: a rate of the whole job, not of one rank), ``first``
(rank 0's value: gauges every rank reads the same, such as the learning rate) and ``concat``
(every rank's values in rank order: distributions).

Definitions every formula uses:

- ``asst``: ``assistant_mask & attention_mask``; for log-prob metrics position 0 is excluded
  (no logit predicts it). Values under a False mask are never read: a NaN there counts nothing.
- ``logp``: the current policy's log-prob of the sampled token, from ``logits / T`` where ``T``
  is the sampling temperature (TRL divides its logits by ``temperature`` the same way); the
  entropy uses the same tempered distribution.
- ``old_logp``: the trainer's recomputation of the log-probs under the weights that generated
  (or were last synced before) the batch, when given (``old_log_probs``; TRL's
  ``old_per_token_logps``); otherwise the sampler's ``sample_log_probs``. ``sample_logp`` is
  always the sampler's (the inference engine's).
- KL estimators (Schulman): at tokens ``x`` sampled from ``q``, with ``log r = log p(x) - log
  q(x)``, ``k1 = -log r`` and ``k3 = r - 1 - log r`` estimate ``KL(q || p)``. They are unbiased
  only when the tokens were sampled from ``q``; the formulas say which ``q`` is meant.
- Zero-length sequences (no ``asst`` token) add no token to ``tok`` metrics; they count in
  lengths, rewards, truncation and staleness, and are left out of the per-sequence means of
  quantities defined over a sequence's tokens (a token-level advantage, ``seq_k1``).
- NaN rewards are left out of every reward statistic (mean, std, min, max, per function); a
  GRPO group holding a NaN reward is not flat (``zero_std_frac``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.contracts.metrics import METRIC_NAME

Reduction = Literal["tok", "seq", "sum", "min", "max", "last", "rate", "hist"]
Ranks = Literal["pairs", "moments", "sum", "max", "min", "rate", "first", "concat"]


def default_ranks(name: str, unit: str, reduction: str) -> str:
    """The ``ranks`` rule a metric gets unless it names one.

    Example:
        >>> default_ranks("time/rollout_s", "s", "sum"), default_ranks("rollout/reward/std", "1", "seq")
        ('max', 'moments')
    """
    if reduction == "hist":
        return "concat"
    if reduction in ("tok", "seq"):
        return "moments" if name.endswith(("/std", "/ess")) else "pairs"
    if reduction == "sum":
        return "max" if unit == "s" else "sum"
    return {"min": "min", "max": "max", "rate": "rate"}.get(reduction, "first")


FRAMEWORKS = ("trl", "nemo_rl", "torchrl", "verl")


class MetricDef(BaseModel):
    """One metric: what it is, in which unit, how it reduces, and the exact formula.

    ``per`` names a family (``reward_fn``: one series per reward function, the name's
    ``<reward_fn>`` segment replaced by the function's name). ``ranks`` says how ranks combine
    (default from the reduction: :func:`default_ranks`). ``crosswalk`` gives the frameworks'
    nearest metric and how it differs (empty: none).

    Example:
        >>> m = CATALOGUE_V1.metric("policy/kl_ref/k3")
        >>> m.reduction, m.unit, m.ranks
        ('tok', 'nats', 'pairs')
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    unit: str
    reduction: Reduction
    formula: str
    inputs: tuple[str, ...]
    section: str
    per: Literal["reward_fn"] | None = None
    since: str = "1.0"
    ranks: Ranks = "pairs"
    crosswalk: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _default_ranks(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ranks") is None:
            data = {
                **data,
                "ranks": default_ranks(
                    str(data.get("name", "")),
                    str(data.get("unit", "")),
                    str(data.get("reduction", "")),
                ),
            }
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not METRIC_NAME.match(v.replace("<reward_fn>", "x")):
            raise ValueError(f"metric name {v!r} must match {METRIC_NAME.pattern}")
        return v

    @field_validator("crosswalk")
    @classmethod
    def _frameworks(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(FRAMEWORKS))
        if unknown:
            raise ValueError(f"crosswalk: unknown frameworks {unknown}; known {list(FRAMEWORKS)}")
        return v


class Catalogue(BaseModel):
    """A versioned set of metrics (additive minor versions, as the contracts).

    Example:
        >>> CATALOGUE_V1.version, len(CATALOGUE_V1.metrics) > 40
        ('1.3', True)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: str
    metrics: tuple[MetricDef, ...]

    @model_validator(mode="after")
    def _unique(self) -> Catalogue:
        names = [m.name for m in self.metrics]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"catalogue {self.name}: duplicate names {dup}")
        return self

    def metric(self, name: str) -> MetricDef:
        """The metric with this name (``KeyError`` listing the sections otherwise)."""
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(
            f"catalogue {self.name} v{self.version} has no metric {name!r}; sections: "
            f"{sorted({m.section for m in self.metrics})}"
        )


def _m(
    name: str,
    unit: str,
    reduction: Reduction,
    formula: str,
    inputs: tuple[str, ...],
    *,
    since: str = "1.0",
    ranks: Ranks | None = None,
    **crosswalk: str,
) -> MetricDef:
    per: Literal["reward_fn"] | None = "reward_fn" if "<reward_fn>" in name else None
    return MetricDef(
        name=name,
        unit=unit,
        reduction=reduction,
        formula=formula,
        inputs=inputs,
        section=name.split("/")[0],
        per=per,
        since=since,
        ranks=ranks,  # type: ignore[arg-type]  # None: the validator's default
        crosswalk=crosswalk,
    )


_TOKMEAN = "over asst tokens of the whole global batch (one (sum, count) pair across microbatches and ranks)"

CATALOGUE_V1 = Catalogue(
    name="posttrain-metrics",
    version="1.3",
    metrics=(
        # --- rollout: rewards, groups, advantages, lengths -------------------------------
        _m("rollout/reward/mean", "1", "seq", "sum_i r_i / n over sequences with a finite reward (NaN rewards excluded from both)", ("reward",),
           trl="reward (nanmean per step; steps then averaged)", nemo_rl="train/reward", torchrl="—",
           verl="critic/score/mean (sum of a sequence's token scores; aborted sequences excluded)"),
        _m("rollout/reward/std", "1", "seq", "population std of the finite rewards over the sequences, from merged (count, mean, M2) moments in float64", ("reward",),
           trl="reward_std (unbiased nanstd per generation batch)"),
        _m("rollout/reward/min", "1", "min", "min_i r_i over finite rewards", ("reward",), nemo_rl="train/min_total_reward",
           verl="critic/score/min"),
        _m("rollout/reward/max", "1", "max", "max_i r_i over finite rewards", ("reward",), nemo_rl="train/max_total_reward",
           verl="critic/score/max"),
        _m("rollout/reward_fn/<reward_fn>/mean", "1", "seq", "mean over sequences of reward function f's finite values (before weighting)", ("reward_fn:<f>",),
           trl="rewards/<name>/mean (nanmean per generation batch)"),
        _m("rollout/reward_fn/<reward_fn>/std", "1", "seq", "population std of reward function f's finite values over sequences (before weighting), from merged moments", ("reward_fn:<f>",),
           since="1.1", trl="rewards/<name>/std (unbiased nanstd per generation batch)"),
        _m("rollout/group/zero_std_frac", "1", "seq", "fraction of GRPO groups (same group_id) whose rewards are all equal (a group holding a NaN reward is not flat; a group of one is flat)", ("reward", "group_id"),
           trl="frac_reward_zero_std (per sample of the group's nanstd isclose to 0: equal groups give the same fraction; a NaN ignored there)", nemo_rl="train/baseline_reward/pct_0 + pct_1 (binary rewards only)"),
        _m("rollout/advantage/mean", "1", "seq", "mean over sequences of the sequence's advantage (a [B, T] advantage: its token mean over asst, values outside asst never read; sequences without asst tokens left out)", ("advantage",),
           nemo_rl="train/advantages/mean",
           verl="critic/advantages/mean (over response tokens: long responses weigh more)"),
        _m("rollout/advantage/std", "1", "seq", "population std over the sequences' advantages (as in rollout/advantage/mean), from merged moments in float64", ("advantage",),
           trl="— (TRL keeps the advantages, logs none: the callback computes this from them)"),
        _m("rollout/advantage/min", "1", "min", "min over the sequences' advantages (as in rollout/advantage/mean)", ("advantage",), nemo_rl="train/advantages/min",
           verl="critic/advantages/min (over response tokens)"),
        _m("rollout/advantage/max", "1", "max", "max over the sequences' advantages (as in rollout/advantage/mean)", ("advantage",), nemo_rl="train/advantages/max",
           verl="critic/advantages/max (over response tokens)"),
        _m("rollout/response_len/mean", "tokens", "seq", "mean over sequences of sum_t asst[t] (zero-length responses included)", ("assistant_mask",),
           trl="completions/mean_length", nemo_rl="train/mean_gen_tokens_per_sample",
           verl="response_length/mean (aborted zero-length sequences included)"),
        _m("rollout/response_len/min", "tokens", "min", "min over sequences of sum_t asst[t]", ("assistant_mask",), trl="completions/min_length",
           verl="response_length/min"),
        _m("rollout/response_len/max", "tokens", "max", "max over sequences of sum_t asst[t]", ("assistant_mask",),
           trl="completions/max_length", nemo_rl="train/max_gen_tokens_per_sample",
           verl="response_length/max"),
        _m("rollout/prompt_len/mean", "tokens", "seq", "mean over sequences of the real tokens before the first asst token", ("attention_mask", "assistant_mask"),
           nemo_rl="train/mean_prompt_length",
           verl="prompt_length/mean"),
        _m("rollout/prompt_len/max", "tokens", "max", "max over sequences of the real tokens before the first asst token", ("attention_mask", "assistant_mask"),
           verl="prompt_length/max"),
        # --- rollout distributions (reduction hist: through log_histogram, MET-008) ---------
        _m("rollout/response_len", "tokens", "hist", "one value per sequence: sum_t asst[t] (zero-length responses included), the values behind rollout/response_len/mean, /min, /max", ("assistant_mask",),
           since="1.2"),
        _m("rollout/reward", "1", "hist", "one value per sequence with a finite reward: r_i (NaN rewards left out, as in rollout/reward/mean)", ("reward",),
           since="1.2"),
        _m("rollout/advantage", "1", "hist", "one value per sequence: its advantage as in rollout/advantage/mean (a [B, T] advantage: its token mean over asst; sequences without asst tokens left out)", ("advantage",),
           since="1.2"),
        _m("rollout/truncated_frac", "1", "seq", "fraction of sequences whose generation stopped at the length limit (finish reason, not the tensor width)", ("truncated",),
           trl="completions/clipped_ratio (last token not EOS/pad)", nemo_rl="train/truncation_rate", verl="response_length/clip_ratio (length == the limit, not the finish reason)"),
        # --- policy: KL, entropy, ratios, clipping --------------------------------------
        _m("policy/kl_ref/k1", "nats", "tok", f"k1 = logp - ref_logp at the sampled tokens, {_TOKMEAN}: estimates KL(policy || ref) when the tokens were sampled from the policy (on-policy, at temperature T)", ("log_probs(policy)", "ref_log_probs", "assistant_mask"),
           verl="actor/reward_kl_penalty (only with use_kl_in_reward; old policy; token mean per sequence, then mean over sequences)"),
        _m("policy/kl_ref/k3", "nats", "tok", f"k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 at the sampled tokens, {_TOKMEAN}: estimates KL(policy || ref), unbiased when the tokens were sampled from the policy", ("log_probs(policy)", "ref_log_probs", "assistant_mask"),
           trl="kl (same k3, token mean; only when beta != 0)", nemo_rl="train/kl_penalty (k3 token mean, before the coefficient)",
           torchrl="kl_to_ref (mean over every padded position: diluted)",
           verl="actor/kl_loss (low_var_kl: k3 clamped to [-10, 10], aggregated by loss_agg_mode, summed over mini-batches in the legacy worker)"),
        _m("policy/kl_ref/seq_k1", "nats", "seq", "mean over sequences with at least one asst token of sum_t asst[t] (logp - ref_logp)", ("log_probs(policy)", "ref_log_probs", "assistant_mask")),
        _m("policy/entropy", "nats", "tok", f"-sum_v p_v log p_v over the full vocabulary of softmax(logits / T), {_TOKMEAN}", ("logits(policy)", "assistant_mask"),
           trl="entropy (same)", torchrl="entropy (mean over every padded position: diluted)",
           verl="actor/entropy (full vocabulary, by loss_agg_mode: token mean by default)"),
        _m("policy/entropy/sampled", "nats", "tok", f"-logp of the sampled token, {_TOKMEAN}: an unbiased estimate of policy/entropy only when the tokens were sampled from the policy at the same temperature (on-policy)", ("log_probs(policy)", "assistant_mask"),
           nemo_rl="train/approx_entropy",
           verl="rollout_corr/training_log_ppl (closest: token mean of -old_logp per sequence, then mean over sequences)"),
        _m("policy/ratio/mean", "1", "tok", f"exp(logp - old_logp) (old_logp: the trainer's recomputed old log-probs when given, else the sampler's), {_TOKMEAN}", ("log_probs(policy)", "old_log_probs|sample_log_probs", "assistant_mask"),
           nemo_rl="train/probs_ratio"),
        _m("policy/ratio/min", "1", "min", "min over asst tokens of exp(logp - old_logp) (NaN if any is NaN)", ("log_probs(policy)", "old_log_probs|sample_log_probs", "assistant_mask"),
           nemo_rl="train/probs_ratio_min"),
        _m("policy/ratio/max", "1", "max", "max over asst tokens of exp(logp - old_logp) (NaN if any is NaN)", ("log_probs(policy)", "old_log_probs|sample_log_probs", "assistant_mask"),
           nemo_rl="train/probs_ratio_max"),
        _m("policy/clip_frac/low", "1", "tok", f"[ratio < 1 - eps_low and A < 0] (the clip that binds for a negative advantage; ratio against old_logp as in policy/ratio/mean), {_TOKMEAN}", ("ratio", "advantage", "assistant_mask"),
           trl="clip_ratio/low_mean (same, against old_per_token_logps; TRL's window mean is a mean of micro-batch means: the callback weights each by its token count)", torchrl="clip_fraction (both sides, sign-blind, over every padded position)",
           verl="actor/pg_clipfrac (low and high counted together; actor/pg_clipfrac_lower is the dual clip)"),
        _m("policy/clip_frac/high", "1", "tok", f"[ratio > 1 + eps_high and A > 0] (ratio against old_logp as in policy/ratio/mean), {_TOKMEAN}", ("ratio", "advantage", "assistant_mask"),
           trl="clip_ratio/high_mean (same, against old_per_token_logps; the callback weights each micro-batch by its token count)",
           verl="actor/pg_clipfrac (low and high counted together)"),
        _m("policy/mismatch_kl", "nats", "tok", f"k3 with log r = old_logp - sample_logp at the sampled tokens, {_TOKMEAN}: estimates KL(sampler || trainer's old policy), unbiased (the tokens are the sampler's); only when old_log_probs are given", ("sample_log_probs", "old_log_probs", "assistant_mask"),
           nemo_rl="train/gen_kl_error", trl="sampling/sampling_logp_difference/mean (mean |diff|, not KL)",
           verl="rollout_corr/k3_kl (k3 of rollout vs old log-probs; only with rollout correction)"),
        _m("policy/update_kl/k1", "nats", "tok", f"k1 = old_logp - logp at the sampled tokens (old_logp as in policy/ratio/mean), {_TOKMEAN}: estimates KL(old policy || policy) where the tokens were sampled from the old policy", ("log_probs(policy)", "old_log_probs|sample_log_probs", "assistant_mask"),
           since="1.1", torchrl="kl_approx (prox - current log-prob, mean over every padded position: diluted)",
           verl="actor/ppo_kl (masked mean of old_log_prob - log_prob; mean over micro-batches)"),
        _m("policy/update_kl/k3", "nats", "tok", f"k3 with log r = logp - old_logp at the sampled tokens, {_TOKMEAN}: estimates KL(old policy || policy), never negative", ("log_probs(policy)", "old_log_probs|sample_log_probs", "assistant_mask"),
           since="1.1"),
        _m("policy/ratio/ess", "1", "tok", "normalized effective sample size of the importance weights w = exp(logp - old_logp) over the asst tokens of the whole global batch: (sum w)^2 / (n sum w^2), 1 when every weight is equal; from merged moments of w", ("log_probs(policy)", "old_log_probs|sample_log_probs", "assistant_mask"),
           since="1.1", torchrl="ESS (same formula over one loss call's masked tokens)"),
        # --- loss and optimiser -----------------------------------------------------------
        _m("loss/total", "1", "sum", "the objective backpropagated: sum of the loss terms, each normalized by the global batch's counts (summed over micro-batches and ranks: each rank's term is its share)", ("loss",),
           trl="loss", nemo_rl="train/loss", torchrl="sum of loss_* entries",
           verl="actor/loss (new worker engine only)"),
        _m("loss/policy", "1", "sum", "the policy-gradient term", ("loss:loss_objective",), trl="policy_loss", torchrl="loss_objective",
           verl="actor/pg_loss (summed over mini-batches in the legacy worker)"),
        _m("loss/kl", "1", "sum", "coefficient times the KL-to-reference term", ("loss:loss_kl_to_ref",), torchrl="loss_kl_to_ref",
           verl="actor/kl_loss times actor/kl_coef (logged apart)"),
        _m("loss/entropy", "1", "sum", "minus coefficient times the entropy term", ("loss:loss_entropy",), torchrl="loss_entropy",
           verl="actor/entropy_loss (new worker engine; before the coefficient)"),
        _m("loss/nll", "1", "sum", "the negative log-likelihood term of supervised fine-tuning: sum over asst tokens (position 0 excluded) of -logp, divided by the global batch's count of those tokens (logp at temperature 1)", ("loss:loss_nll",),
           since="1.3", trl="loss (SFTTrainer, completion-only loss)"),
        _m("optim/grad_norm", "1", "last", "global L2 norm of the gradients before clipping", ("optimizer",), trl="grad_norm", nemo_rl="train/grad_norm",
           verl="actor/grad_norm (before clipping; mean over mini-batches)"),
        _m("optim/lr", "1", "last", "learning rate of the step", ("optimizer",), trl="learning_rate", nemo_rl="train/lr",
           verl="actor/lr"),
        # --- time and throughput ------------------------------------------------------------
        _m("time/rollout_s", "s", "sum", "wall time spent generating (summed over calls; across ranks the slowest rank's)", ("timer:rollout",), nemo_rl="timing/train/generation",
           verl="timing_s/gen"),
        _m("time/weight_sync_s", "s", "sum", "wall time of weight sync (trainer to generator)", ("timer:weight_sync",),
           nemo_rl="timing/train/prepare_for_generation/transfer_and_update_weights",
           verl="timing_s/update_weights"),
        _m("time/train_s", "s", "sum", "wall time of the optimizer step(s)", ("timer:train",), nemo_rl="timing/train/policy_training",
           verl="timing_s/update_actor"),
        _m("time/step_s", "s", "sum", "wall time of the whole step", ("timer:step",), nemo_rl="timing/train/total_step_time",
           verl="timing_s/step"),
        _m("perf/gen_tokens_per_s", "tokens/s", "rate", "generated tokens (sum asst) / time/rollout_s; across ranks all ranks' tokens over the slowest rank's seconds (the job's rate, not one rank's)", ("assistant_mask", "timer:rollout"),
           nemo_rl="— (none out of the box)",
           verl="timing_per_token_ms/gen (the inverse: ms per generated token)"),
        _m("perf/train_tokens_per_s", "tokens/s", "rate", "trained tokens (sum attention) / time/train_s; across ranks all ranks' tokens over the slowest rank's seconds", ("attention_mask", "timer:train"),
           nemo_rl="timing/train/valid_tokens_per_sec_per_gpu (per GPU)",
           verl="perf/throughput (prompt and response tokens per step second per GPU)"),
        _m("perf/gen_tokens_per_s_per_rank", "tokens/s", "rate", "generated tokens of all ranks / the seconds of time/rollout_s of all ranks summed: one rank's mean rate (equals perf/gen_tokens_per_s on one rank)", ("assistant_mask", "timer:rollout"),
           since="1.1", ranks="pairs"),
        _m("perf/train_tokens_per_s_per_rank", "tokens/s", "rate", "trained tokens of all ranks / the seconds of time/train_s of all ranks summed: one rank's mean rate", ("attention_mask", "timer:train"),
           since="1.1", ranks="pairs", nemo_rl="timing/train/valid_tokens_per_sec_per_gpu (valid tokens per GPU-second)"),
        # --- staleness ------------------------------------------------------------------------
        _m("staleness/policy_version", "1", "last", "the learner's weights version", ("learner",),
           verl="fully_async/count/current_param_version (fully-async mode only)"),
        _m("staleness/mean", "versions", "seq", "mean over sequences of learner version - policy_version, the learner version being that of the weights the batch's gradient step starts from, counted as the source stamps policy_version (0 in an on-policy loop, the buffer's lag off-policy)", ("policy_version",),
           nemo_rl="train/avg_trajectory_age (async)"),
        _m("staleness/max", "versions", "max", "max over sequences of learner version - policy_version (as staleness/mean)", ("policy_version",)),
        # --- buffer ---------------------------------------------------------------------------
        _m("buffer/size", "items", "last", "len(buffer)", ("buffer",),
           verl="fully_async/monitor/queue/mq_queue_size (fully-async mode only)"),
        _m("buffer/capacity", "items", "last", "the buffer's capacity", ("buffer",),
           verl="fully_async/static/max_queue_size (fully-async mode only)"),
        _m("buffer/utilization", "1", "last", "buffer/size / buffer/capacity", ("buffer",)),
        _m("buffer/writes", "items", "sum", "items written (extend)", ("buffer",)),
        _m("buffer/reads", "items", "sum", "items sampled or read", ("buffer",)),
        # --- generation server (GenerationServerV1.stats()) ------------------------------------
        _m("gen_server/queue_wait_s", "s", "last", "the server's mean (or median) wait of a request in the queue before its batch ran", ("gen_server",),
           torchrl="p50_queue_ms (InferenceServer.stats, milliseconds)"),
        _m("gen_server/batch_size", "items", "last", "the server's mean number of requests per batch", ("gen_server",),
           torchrl="avg_batch_size"),
        _m("gen_server/forward_s", "s", "last", "the server's mean (or median) time of one batch's forward pass", ("gen_server",),
           torchrl="p50_forward_ms (milliseconds)"),
        # --- reward model ---------------------------------------------------------------------
        _m("reward_model/accuracy", "1", "seq", "fraction of pairs with score(chosen) > score(rejected)", ("pairs",), trl="accuracy (RewardTrainer)"),
        _m("reward_model/margin", "1", "seq", "mean over pairs of score(chosen) - score(rejected)", ("pairs",), trl="margin (RewardTrainer)"),
        _m("reward_model/loss", "1", "seq", "Bradley-Terry loss: mean over pairs of -log sigmoid(score(chosen) - score(rejected)), computed as softplus(score(rejected) - score(chosen))", ("pairs",),
           since="1.3", trl="loss (RewardTrainer without a margin column or center_rewards_coefficient; a mean of micro-batch means)"),
        _m("reward_model/margin/std", "1", "seq", "population std over pairs of score(chosen) - score(rejected), from merged (count, mean, M2) moments in float64", ("pairs",),
           since="1.3"),
        # --- selection (best-of-n rejection sampling, expert iteration) ------------------------
        _m("selection/rate", "1", "seq", "fraction of generated sequences kept by the selection (best-of-n keeping the top k of each group of n: k / n)", ("reward", "selected"),
           since="1.3"),
        _m("selection/reward/mean", "1", "seq", "mean over the kept sequences with a finite reward of r_i (rollout/reward/mean is the same before selection)", ("reward", "selected"),
           since="1.3"),
        _m("selection/reward/std", "1", "seq", "population std of the kept sequences' finite rewards, from merged moments in float64", ("reward", "selected"),
           since="1.3"),
        _m("selection/reward/min", "1", "min", "min over the kept sequences' finite rewards", ("reward", "selected"),
           since="1.3"),
        _m("selection/reward/max", "1", "max", "max over the kept sequences' finite rewards", ("reward", "selected"),
           since="1.3"),
        _m("selection/response_len/mean", "tokens", "seq", "mean over the kept sequences of sum_t asst[t]", ("assistant_mask", "selected"),
           since="1.3"),
    ),
)  # fmt: skip
"""The catalogue v1 (spec: ``specs/metrics_catalogue-v1.md``)."""

RECIPES = ("grpo", "expert_iteration", "reward_model")
"""The recipes :func:`recipe_metrics` covers: GRPO, expert iteration (best-of-n rejection
sampling then SFT on the kept answers) and reward-model training (Bradley-Terry on pairs)."""

_NOT_IN = {
    # Expert iteration: no advantage (a flat group still shows: nothing to choose between), no reference, no importance weights (SFT on kept answers).
    "expert_iteration": (
        "rollout/advantage",
        "policy/kl_ref/",
        "policy/ratio/",
        "policy/clip_frac/",
        "policy/mismatch_kl",
        "policy/update_kl/",
        "loss/policy",
        "loss/kl",
        "loss/entropy",
        "reward_model/",
    ),
    # GRPO: nothing is selected and nothing is imitated.
    "grpo": ("selection/", "loss/nll", "reward_model/"),
}
# Reward-model training generates nothing: no rollout, policy, staleness or server metric.
_RM_ONLY = (
    "reward_model/",
    "loss/total",
    "optim/",
    "time/train_s",
    "time/step_s",
    "perf/train_tokens_per_s",
    "buffer/",
)


def recipe_metrics(recipe: str, cat: Catalogue = CATALOGUE_V1) -> tuple[str, ...]:
    """The catalogue metrics a recipe's loop emits when it calls every hook that applies;
    the others do not apply to it.

    Example:
        >>> "selection/rate" in recipe_metrics("expert_iteration"), "selection/rate" in recipe_metrics("grpo")
        (True, False)
        >>> recipe_metrics("ppo")
        Traceback (most recent call last):
        ...
        KeyError: "recipe: expected one of ('grpo', 'expert_iteration', 'reward_model'), found 'ppo'"
    """
    if recipe not in RECIPES:
        raise KeyError(f"recipe: expected one of {RECIPES}, found {recipe!r}")
    names = [m.name for m in cat.metrics]
    if recipe == "reward_model":
        return tuple(n for n in names if n.startswith(_RM_ONLY))
    return tuple(n for n in names if not n.startswith(_NOT_IN[recipe]))


def recipe_table(cat: Catalogue = CATALOGUE_V1) -> str:
    """The recipe x metric table (Markdown) of :func:`recipe_metrics`.

    Example:
        >>> recipe_table().splitlines()[0]
        '| metric | grpo | expert_iteration | reward_model |'
    """
    emitted = {r: set(recipe_metrics(r, cat)) for r in RECIPES}
    lines = ["| metric | " + " | ".join(RECIPES) + " |", "|---|" + "---|" * len(RECIPES)]
    for m in cat.metrics:
        cells = ["emitted" if m.name in emitted[r] else "n/a" for r in RECIPES]
        lines.append(f"| `{m.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
