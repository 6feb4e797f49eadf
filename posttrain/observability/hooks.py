"""Hooks that compute the catalogue's metrics from a layout batch, a policy's logits, a loss
output, a buffer and timers, into an :class:`~posttrain.observability.reduce.Accumulator`.

Every token metric is a (sum over masked tokens, count) pair and every sequence metric a (sum,
count) pair, so padding never dilutes and microbatches add up. All hooks run under
``torch.no_grad`` and cost a few tensor operations per metric: cheap enough for every step.
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._kl import kl_estimate
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.observability.reduce import Accumulator
from posttrain.observability.reduce import one_number as _number


def _dense(td: TensorDictBase, layout: Layout) -> TensorDictBase:
    if not isinstance(td, LazyStackedTensorDict):
        return td.reshape(-1) if td.batch_dims != 1 else td
    # Ragged: pad per-token fields with False/0 (masks decide; values under False are unread).
    tok = layout.key("tokens")
    lengths = [x.get(tok).shape[-1] for x in td.tensordicts]
    out = {}
    for key in td.tensordicts[0].keys(include_nested=True, leaves_only=True):
        vs = [x.get(key) for x in td.tensordicts]
        if all(v.ndim >= 1 and v.shape[0] == n for v, n in zip(vs, lengths, strict=True)):
            out[key] = torch.nn.utils.rnn.pad_sequence(vs, batch_first=True, padding_value=0)
        else:
            out[key] = torch.stack(vs)
    return TensorDict(out, batch_size=[len(lengths)])


def _checked(td: TensorDictBase, layout: Layout, context: str) -> tuple[TensorDictBase, int]:
    """``td`` padded to one dense batch and checked against ``layout``; its sequence count.

    Hooks check before their first write: an accumulator must not keep half a batch's metrics.
    Any float dtype passes (metrics are computed in float32). A ragged stack is checked item
    by item, before padding: padding would hide one item's dtype under the others'.
    """
    ragged = isinstance(td, LazyStackedTensorDict)
    layout.validate_batch(td, ragged=ragged, any_float=True, context=context)
    dense = _dense(td, layout)
    n = int(dense.batch_size.numel())
    if n == 0:
        # Its min and max metrics are undefined, and skipping them would leave ranks holding
        # different metric names for all_reduce.
        raise ValueError(f"{context}: expected at least one sequence, found batch size [0]")
    return dense, n


def _per_sequence(key: str, x: Any, n: int) -> None:
    if not isinstance(x, torch.Tensor) or x.numel() != n:
        found = (
            f"a tensor of shape {list(x.shape)}"
            if isinstance(x, torch.Tensor)
            else type(x).__name__
        )
        raise ValueError(
            f"{key}: expected a tensor of {n} values (one per sequence), found {found}"
        )


def _seq(acc: Accumulator, name: str, values: torch.Tensor) -> None:
    acc.add(name, values.sum(dtype=torch.float64), values.numel())


@torch.no_grad()
def rollout_metrics(
    td: TensorDictBase,
    acc: Accumulator | None = None,
    *,
    learner_version: int | None = None,
    truncated: torch.Tensor | None = None,
    reward_fns: Mapping[str, torch.Tensor] | None = None,
    histograms: bool = False,
    layout: Layout = LLM_LAYOUT_V1,
) -> Accumulator:
    """Rewards, groups, advantages, lengths, truncation and staleness of a rollout batch.

    Group metrics need whole groups: call it on the rollout batch (or on microbatches that
    do not split a ``group_id``). With ``histograms``, the per-sequence values behind the
    length, reward and advantage statistics are kept too, as the catalogue's distributions
    ``rollout/response_len``, ``rollout/reward`` and ``rollout/advantage`` (finite values;
    :meth:`Accumulator.log_to` writes them through the sink's ``log_histogram``).

    Example:
        >>> from posttrain.testing import llm_batch
        >>> vals = rollout_metrics(llm_batch(4, 8), learner_version=9).values()
        >>> vals["staleness/mean"], vals["rollout/response_len/max"] <= 5
        (2.0, True)
        >>> sorted(rollout_metrics(llm_batch(4, 8), histograms=True).histograms())
        ['rollout/advantage', 'rollout/response_len', 'rollout/reward']
        >>> rollout_metrics(llm_batch(2, 4), truncated=torch.ones(3, dtype=torch.bool))
        Traceback (most recent call last):
        ...
        ValueError: truncated: expected a tensor of 2 values (one per sequence), found a tensor of shape [3]
    """
    acc = acc if acc is not None else Accumulator()
    td, n_seq = _checked(td, layout, "rollout_metrics")
    learner_version = _rollout_args(acc, n_seq, truncated, reward_fns, learner_version)
    k = layout.key
    attn = td.get(k("attention_mask"))
    asst = td.get(k("assistant_mask")) & attn
    reward = td.get(k("reward"), None)
    if reward is not None:
        _reward_stats(acc, reward, td.get(k("group_id"), None), histograms)
    adv = td.get(k("advantage"), None)
    if adv is not None:
        _advantage_stats(acc, adv, asst, histograms)
    _length_stats(acc, attn, asst, histograms)
    if truncated is not None:
        _seq(acc, "rollout/truncated_frac", truncated.double().reshape(-1))
    for name, values in (reward_fns or {}).items():
        v = values.double().reshape(-1)
        v = v[torch.isfinite(v)]
        _seq(acc, f"rollout/reward_fn/{name}/mean", v)
        acc.add_values(f"rollout/reward_fn/{name}/std", v)
    version = td.get(k("policy_version"), None)
    if learner_version is not None:
        acc.add("staleness/policy_version", learner_version)
        if version is not None:
            age = (learner_version - version.reshape(-1)).double()
            _seq(acc, "staleness/mean", age)
            acc.add("staleness/max", age.max())
    return acc


def _rollout_args(
    acc: Accumulator,
    n_seq: int,
    truncated: torch.Tensor | None,
    reward_fns: Mapping[str, torch.Tensor] | None,
    learner_version: int | None,
) -> int | None:
    """Refuse a bad argument before the first write; the learner version as an int."""
    if truncated is not None:
        _per_sequence("truncated", truncated, n_seq)
    for name, values in (reward_fns or {}).items():
        _per_sequence(f"reward_fns[{name!r}]", values, n_seq)
        # A name the catalogue cannot match (one with a '/') raises its KeyError here, not
        # after the batch's other metrics are in.
        acc.reduction(f"rollout/reward_fn/{name}/mean")
    if learner_version is None:
        return None
    try:
        return operator.index(learner_version)
    except TypeError:
        raise ValueError(f"learner_version: expected an int, found {learner_version!r}") from None


def _reward_stats(acc: Accumulator, reward: torch.Tensor, group: Any, histograms: bool) -> None:
    """``rollout/reward/*`` over the finite rewards, and the share of flat groups."""
    r = reward.double().reshape(-1)
    ok = r[torch.isfinite(r)]
    _seq(acc, "rollout/reward/mean", ok)
    acc.add_values("rollout/reward/std", ok)
    if ok.numel():
        acc.add("rollout/reward/min", ok.min())
        acc.add("rollout/reward/max", ok.max())
    if histograms:
        acc.add_hist("rollout/reward", ok)
    if group is not None:
        # A group is flat when its smallest and largest reward agree (a NaN reward equals
        # nothing, so its group is not flat); one scatter per extreme, no loop over groups.
        uniq, inverse = group.reshape(-1).unique(return_inverse=True)
        lo = r.new_full((len(uniq),), torch.inf).scatter_reduce(0, inverse, r, "amin")
        hi = r.new_full((len(uniq),), -torch.inf).scatter_reduce(0, inverse, r, "amax")
        flat = lo == hi
        acc.add("rollout/group/zero_std_frac", int(flat.sum()), len(uniq))


def _advantage_stats(
    acc: Accumulator, adv: torch.Tensor, asst: torch.Tensor, histograms: bool
) -> None:
    """``rollout/advantage/*`` over sequences (a per-token advantage by its sequence's mean)."""
    a = adv.double()
    if a.ndim == 2:
        # The sequence's token mean over its assistant tokens, selected (a NaN outside the
        # mask, as TorchRL writes there, must not leak); sequences without any are left out.
        n_tok = asst.sum(-1)
        a = torch.where(asst, a, 0.0).sum(-1)[n_tok > 0] / n_tok[n_tok > 0]
    a = a.reshape(-1)
    _seq(acc, "rollout/advantage/mean", a)
    acc.add_values("rollout/advantage/std", a)
    if a.numel():
        acc.add("rollout/advantage/min", a.min())
        acc.add("rollout/advantage/max", a.max())
    if histograms:  # a NaN inside the mask shows in /mean; no backend can bin it
        acc.add_hist("rollout/advantage", a[torch.isfinite(a)])


def _length_stats(
    acc: Accumulator, attn: torch.Tensor, asst: torch.Tensor, histograms: bool
) -> None:
    """``rollout/response_len/*`` (assistant tokens) and ``rollout/prompt_len/*``."""
    resp = asst.sum(-1).double()
    if histograms:
        acc.add_hist("rollout/response_len", resp)
    _seq(acc, "rollout/response_len/mean", resp)
    acc.add("rollout/response_len/min", resp.min())
    acc.add("rollout/response_len/max", resp.max())
    prompt = (attn & (asst.int().cumsum(-1) == 0)).sum(-1).double()
    _seq(acc, "rollout/prompt_len/mean", prompt)
    acc.add("rollout/prompt_len/max", prompt.max())


@torch.no_grad()
def policy_metrics(
    td: TensorDictBase,
    logits: torch.Tensor,
    acc: Accumulator | None = None,
    *,
    clip: tuple[float, float] = (0.2, 0.2),
    old_log_probs: torch.Tensor | None = None,
    temperature: float = 1.0,
    layout: Layout = LLM_LAYOUT_V1,
) -> Accumulator:
    """KL to reference, entropy, importance ratios, sign-aware clip fractions, update and
    mismatch KLs, effective sample size.

    ``logits`` [B, T, V] are the current policy's on ``td``'s tokens (logits at t predict
    t+1); they are divided by ``temperature`` (the sampling temperature, as TRL does) before
    the log-probs and the entropy. Ratios, clip fractions, the update KL and the effective
    sample size compare with ``old_log_probs`` (the trainer's recomputation before the update,
    TRL's ``old_per_token_logps``) when given, else with the sampler's ``sample_log_probs``;
    ``policy/mismatch_kl`` (sampler against trainer) needs both.

    Example:
        >>> import torch
        >>> from posttrain.testing import llm_batch
        >>> td = llm_batch(2, 6, vocab_size=8)
        >>> vals = policy_metrics(td, torch.zeros(2, 6, 8)).values()  # uniform policy
        >>> round(vals["policy/entropy"], 4) == round(float(torch.log(torch.tensor(8.0))), 4)
        True
    """
    acc = acc if acc is not None else Accumulator()
    td, _ = _checked(td, layout, "policy_metrics")
    k = layout.key
    tokens = td.get(k("tokens"))
    low_clip, high_clip, temp = _policy_args(tokens, logits, clip, old_log_probs, temperature)
    mask = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
    mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
    n = int(mask.sum())
    logp, ent = _log_probs_and_entropy(logits, tokens, mask, temp)

    def tok(name: str, x: torch.Tensor) -> None:
        # Selected, never multiplied: a NaN or inf under a False mask must count nothing.
        acc.add(name, torch.where(mask, x, 0.0).sum(dtype=torch.float64), n)

    tok("policy/entropy", ent)
    tok("policy/entropy/sampled", -logp)
    sample = td.get(k("sample_log_probs"), None)
    old = old_log_probs if old_log_probs is not None else sample
    if old is not None:
        old = torch.where(mask, old.float(), 0.0)
        log_w = logp - old
        ratio = torch.where(mask, log_w.exp(), 0.0)
        _ratio_stats(acc, tok, ratio, mask, n, log_w)
        adv = td.get(k("advantage"), None)
        if adv is not None:
            a = adv.float()
            a = a[:, None].expand_as(ratio) if a.ndim == 1 else a
            tok("policy/clip_frac/low", ((ratio < 1 - low_clip) & (a < 0)).float())
            tok("policy/clip_frac/high", ((ratio > 1 + high_clip) & (a > 0)).float())
        if old_log_probs is not None and sample is not None:
            d = old - torch.where(mask, sample.float(), 0.0)  # log(old / sampler)
            tok("policy/mismatch_kl", kl_estimate(d))
    ref = td.get(k("ref_log_probs"), None)
    if ref is not None:
        d = torch.where(mask, ref.float(), 0.0) - logp
        tok("policy/kl_ref/k1", kl_estimate(d, "k1"))
        tok("policy/kl_ref/k3", kl_estimate(d))
        seq = torch.where(mask, -d, 0.0).sum(-1, dtype=torch.float64)
        scored = mask.any(-1)
        acc.add("policy/kl_ref/seq_k1", seq[scored].sum(), int(scored.sum()))
    return acc


def _policy_args(
    tokens: torch.Tensor,
    logits: Any,
    clip: Any,
    old_log_probs: Any,
    temperature: Any,
) -> tuple[float, float, float]:
    """Refuse a bad argument before the first write; the clip pair and the temperature."""
    low_clip, high_clip = (_number("clip", c) for c in _pair("clip", clip))
    temp = _number("temperature", temperature)
    if not (temp > 0 and math.isfinite(temp)):
        raise ValueError(f"temperature: expected a finite number > 0, found {temp}")
    _shaped("logits", logits, (*tokens.shape, "V"))
    if old_log_probs is not None:
        _shaped("old_log_probs", old_log_probs, tuple(tokens.shape))
    return low_clip, high_clip, temp


def _log_probs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled tokens' log-probs (0 outside ``mask``) and the full entropy, [B, T] each,
    aligned as :func:`~posttrain.contracts.alignment.token_log_probs` aligns them."""
    # One log-softmax over the vocabulary serves both: the logits are the big tensor here.
    scaled = logits[:, :-1].float()
    if temp != 1.0:
        scaled = scaled / temp
    lp_all = torch.log_softmax(scaled, dim=-1)
    picked = lp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    zero = torch.zeros_like(picked[:, :1])
    logp = torch.where(mask, torch.cat([zero, picked], dim=1), 0.0)
    probs = lp_all.exp()
    ent = -(probs * lp_all).sum(-1)  # a third faster than torch.special.entr's p log p
    bad = ent.isnan()
    if bool(bad.any()):  # a -inf logit (a masked token): its 0 * log 0 counts 0
        ent[bad] = torch.special.entr(probs[bad]).sum(-1)
    return logp, torch.cat([zero, ent], dim=1)


def _ratio_stats(
    acc: Accumulator,
    tok: Callable[[str, torch.Tensor], None],
    ratio: torch.Tensor,
    mask: torch.Tensor,
    n: int,
    log_w: torch.Tensor,
) -> None:
    """Importance ratios against the old log-probs, their ESS and the update KLs."""
    tok("policy/ratio/mean", ratio)
    if n:
        picked_ratio = ratio[mask]
        acc.add("policy/ratio/min", picked_ratio.min())
        acc.add("policy/ratio/max", picked_ratio.max())
        acc.add_values("policy/ratio/ess", picked_ratio)
    tok("policy/update_kl/k1", kl_estimate(log_w, "k1"))
    tok("policy/update_kl/k3", kl_estimate(log_w))


def _pair(key: str, x: Any) -> tuple[Any, Any]:
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise ValueError(f"{key}: expected a (low, high) pair, found {x!r}")
    return x[0], x[1]


def _shaped(key: str, x: Any, shape: tuple[int | str, ...]) -> None:
    """Check that ``x`` is a tensor of ``shape`` (a str is a dim of any size)."""
    ok = isinstance(x, torch.Tensor) and x.ndim == len(shape)
    ok = ok and all(isinstance(s, str) or d == s for d, s in zip(x.shape, shape, strict=True))
    if not ok:
        found = f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        want = "[" + ", ".join(str(s) for s in shape) + "]"
        raise ValueError(f"{key}: expected a tensor of shape {want} (the batch's), found {found}")


def loss_metrics(out: Mapping[str, Any], acc: Accumulator | None = None) -> Accumulator:
    """``loss/total`` (sum of the ``loss_*`` terms) and the named terms of a loss output.

    Example:
        >>> import torch
        >>> loss_metrics({"loss_objective": torch.tensor(1.0), "loss_kl_to_ref": torch.tensor(0.5)}).values()
        {'loss/total': 1.5, 'loss/policy': 1.0, 'loss/kl': 0.5}
    """
    acc = acc if acc is not None else Accumulator()
    terms = {key: _number(repr(key), v) for key, v in out.items() if str(key).startswith("loss_")}
    acc.add("loss/total", sum(terms.values()))
    for key, name in (
        ("loss_objective", "loss/policy"),
        ("loss_kl_to_ref", "loss/kl"),
        ("loss_entropy", "loss/entropy"),
        ("loss_nll", "loss/nll"),
    ):
        if key in terms:
            acc.add(name, terms[key])
    return acc


def reward_model_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, acc: Accumulator | None = None
) -> Accumulator:
    """``reward_model/accuracy`` and ``reward_model/margin`` of preference pairs' scores.

    A pair with a NaN score counts in both (its margin NaN, its comparison False), so a NaN is
    seen rather than dropped.

    Example:
        >>> import torch
        >>> vals = reward_model_metrics(torch.tensor([2.0, 0.5, 1.0]), torch.tensor([1.0, 1.5, 1.0])).values()
        >>> vals["reward_model/accuracy"], vals["reward_model/margin"]  # 1 of 3 pairs; (1 - 1 + 0) / 3
        (0.3333333333333333, 0.0)
    """
    acc = acc if acc is not None else Accumulator()
    if not (isinstance(chosen, torch.Tensor) and isinstance(rejected, torch.Tensor)):
        raise ValueError("chosen, rejected: expected two tensors of scores, one per pair")
    c, r = chosen.detach().double().reshape(-1), rejected.detach().double().reshape(-1)
    if c.numel() != r.numel():
        raise ValueError(
            f"rejected: expected {c.numel()} scores (one per chosen), found {r.numel()}"
        )
    acc.add("reward_model/accuracy", (c > r).sum(dtype=torch.float64), c.numel())
    acc.add("reward_model/margin", (c - r).sum(), c.numel())
    acc.add_values("reward_model/margin/std", c - r)
    # softplus(r - c) = -log sigmoid(c - r) without the overflow of exp at large margins.
    acc.add("reward_model/loss", torch.nn.functional.softplus(r - c).sum(), c.numel())
    return acc


@torch.no_grad()
def selection_metrics(
    td: TensorDictBase,
    selected: torch.Tensor,
    acc: Accumulator | None = None,
    *,
    layout: Layout = LLM_LAYOUT_V1,
) -> Accumulator:
    """What a selection (best-of-n rejection sampling, expert iteration) kept of a batch:
    ``selection/rate`` and the kept sequences' reward statistics and response length.

    ``td`` is the batch before selection (call :func:`rollout_metrics` on it for the same
    statistics before), ``selected`` one bool per sequence. A selection that keeps nothing
    reports rate 0 and no reward statistic.

    Example:
        >>> import torch
        >>> from posttrain.testing import llm_batch
        >>> td = llm_batch(4, 8)
        >>> td["next", "reward"] = torch.tensor([0.0, 1.0, 2.0, 3.0])
        >>> vals = selection_metrics(td, torch.tensor([False, True, False, True])).values()
        >>> vals["selection/rate"], vals["selection/reward/mean"], vals["selection/reward/min"]
        (0.5, 2.0, 1.0)
    """
    acc = acc if acc is not None else Accumulator()
    td, n_seq = _checked(td, layout, "selection_metrics")
    _per_sequence("selected", selected, n_seq)
    if selected.dtype != torch.bool:
        raise ValueError(f"selected: expected a bool tensor, found dtype {selected.dtype}")
    keep = selected.reshape(-1)
    k = layout.key
    asst = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
    _seq(acc, "selection/rate", keep.double())
    _seq(acc, "selection/response_len/mean", asst.sum(-1).double()[keep])
    reward = td.get(k("reward"), None)
    if reward is not None:
        r = reward.double().reshape(-1)[keep]
        ok = r[torch.isfinite(r)]
        _seq(acc, "selection/reward/mean", ok)
        acc.add_values("selection/reward/std", ok)
        if ok.numel():
            acc.add("selection/reward/min", ok.min())
            acc.add("selection/reward/max", ok.max())
    return acc


def optim_metrics(
    grad_norm: float | torch.Tensor, lr: float, acc: Accumulator | None = None
) -> Accumulator:
    """``optim/grad_norm`` and ``optim/lr`` of the step.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        >>> optim_metrics(norm, lr=1e-3).values()  # the norm before clipping: sqrt(3)
        {'optim/grad_norm': 1.73205..., 'optim/lr': 0.001}
    """
    acc = acc if acc is not None else Accumulator()
    norm, rate = _number("grad_norm", grad_norm), _number("lr", lr)
    acc.add("optim/grad_norm", norm)
    acc.add("optim/lr", rate)
    return acc


def buffer_metrics(
    buffer: Any,
    acc: Accumulator | None = None,
    *,
    capacity: int | None = None,
    writes: int = 0,
    reads: int = 0,
) -> Accumulator:
    """Size, capacity and utilization of a ``ReplayBufferV1``; writes and reads since last time.

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.testing import llm_batch
        >>> rb = RingBuffer(8); _ = rb.extend(llm_batch(2))
        >>> buffer_metrics(rb, writes=2).values()["buffer/utilization"]
        0.25
    """
    acc = acc if acc is not None else Accumulator()
    size = len(buffer)
    cap = capacity if capacity is not None else getattr(buffer, "capacity", None)
    cap = None if cap is None else _number("capacity", cap)
    counts = {"buffer/writes": _number("writes", writes), "buffer/reads": _number("reads", reads)}
    acc.add("buffer/size", size)
    if cap:
        acc.add("buffer/capacity", cap)
        acc.add("buffer/utilization", size / cap)
    for name, v in counts.items():
        acc.add(name, v)
    return acc


def generation_server_metrics(server: Any, acc: Accumulator | None = None) -> Accumulator:
    """``gen_server/*`` from a ``GenerationServerV1``'s ``stats()``.

    Example:
        >>> class S:
        ...     def stats(self): return {"queue_wait_s": 0.01, "batch_size": 4.0, "forward_s": 0.2}
        >>> generation_server_metrics(S()).values()["gen_server/batch_size"]
        4.0
    """
    acc = acc if acc is not None else Accumulator()
    stats = server.stats()
    values = {
        f"gen_server/{key}": _number(f"stats()[{key!r}]", stats[key])
        for key in ("queue_wait_s", "batch_size", "forward_s")
        if key in stats
    }
    for name, v in values.items():
        acc.add(name, v)
    return acc


_TWINS = {"perf/gen_tokens_per_s_per_rank", "perf/train_tokens_per_s_per_rank"}


class Timers:
    """Phase timers: ``with timers.phase("weight_sync"):`` adds to ``time/weight_sync_s``;
    :meth:`rate` turns counted tokens and a phase's seconds into a ``perf/`` rate pair.

    Example:
        >>> timers = Timers()
        >>> with timers.phase("rollout"):
        ...     pass
        >>> timers.rate("perf/gen_tokens_per_s", tokens=100, phase="rollout")
        >>> sorted(timers.acc.values())
        ['perf/gen_tokens_per_s', 'perf/gen_tokens_per_s_per_rank', 'time/rollout_s']
    """

    def __init__(self, acc: Accumulator | None = None) -> None:
        self.acc = acc if acc is not None else Accumulator()
        self.last: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``time/<name>_s`` (summed over calls)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.last[name] = seconds
            self.acc.add(f"time/{name}_s", seconds)

    def rate(self, name: str, *, tokens: float, phase: str) -> None:
        """``name`` += (tokens, seconds of the phase's last run), and its ``_per_rank`` twin
        when the catalogue has one (across ranks the first is the job's rate, the twin one
        rank's mean rate)."""
        self.acc.add(name, tokens, self.last[phase])
        twin = f"{name}_per_rank"
        if twin in _TWINS:
            self.acc.add(twin, tokens, self.last[phase])
