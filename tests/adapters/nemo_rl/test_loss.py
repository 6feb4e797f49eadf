"""NeMo-RL losses both ways (posttrain.adapters.nemo_rl.loss) against NeMo-RL's own vector."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from posttrain.adapters.nemo_rl.loss import (
    ContractAsNemoLoss,
    NemoLossModule,
    clipped_pg_loss,
    global_counts,
)
from posttrain.adapters.nemo_rl.mirror.loss_functions import CLIPPED_PG_DEFAULTS, clipped_pg_options
from posttrain.adapters.nemo_rl.train_data import NemoFormatError
from posttrain.policy_loss import PolicyLoss
from posttrain.testing import llm_batch, tiny_causal_lm
from tests.paths import DATA

V = json.loads((DATA / "nemo_rl.json").read_text())["clipped_pg_loss"]


def _data() -> dict[str, torch.Tensor]:
    d = V["data"]
    out = {k: torch.tensor(v, dtype=torch.float32) for k, v in d.items()}
    out["input_ids"] = out["input_ids"].long()
    out["token_mask"] = out["token_mask"].long()
    return out


def _nemo_default() -> ContractAsNemoLoss:
    # NeMo-RL's default ClippedPGLossConfig: ratio clip 0.2/0.2, k3 KL to reference 0.01,
    # token-level loss.
    return ContractAsNemoLoss(lambda p: PolicyLoss(p, clip_epsilon=0.2, kl_coef=0.01))


def test_vector_loss_and_gradient_of_nemo_rl_clipped_pg_loss() -> None:
    ntl = torch.tensor(V["next_token_logprobs"], requires_grad=True)
    loss, metrics = _nemo_default()(
        next_token_logprobs=ntl,
        data=_data(),
        global_valid_seqs=torch.tensor(float(V["global_valid_seqs"])),
        global_valid_toks=torch.tensor(float(V["global_valid_toks"])),
    )
    assert loss.item() == pytest.approx(V["expected"]["loss"], abs=1e-6)
    assert metrics["loss"] == pytest.approx(V["expected"]["loss"], abs=1e-6)
    torch.autograd.backward(loss)
    assert ntl.grad is not None
    torch.testing.assert_close(
        ntl.grad, torch.tensor(V["expected"]["grad_next_token_logprobs"]), atol=1e-4, rtol=0
    )


def test_global_counts_are_the_vectors() -> None:
    seqs, toks = global_counts(_data())
    assert (seqs.item(), toks.item()) == (V["global_valid_seqs"], V["global_valid_toks"])


@pytest.mark.parametrize("level", ["token_level", "sequence_level"])
def test_microbatches_and_ranks_add_up_to_the_full_batch(level: str) -> None:
    data = _data()
    full_lp = torch.tensor(V["next_token_logprobs"], requires_grad=True)
    loss_fn = ContractAsNemoLoss(
        lambda p: PolicyLoss(
            p,
            kl_coef=0.01,
            aggregation="token_mean" if level == "token_level" else "seq_mean_token_mean",
        ),
        loss_type=level,
    )
    seqs, toks = global_counts(data)
    full, _ = loss_fn(
        next_token_logprobs=full_lp, data=data, global_valid_seqs=seqs, global_valid_toks=toks
    )
    torch.autograd.backward(full)
    parts_lp = torch.tensor(V["next_token_logprobs"], requires_grad=True)
    total = torch.zeros(())
    for i in range(2):  # two microbatches (or two data-parallel ranks) of one row each
        part = {k: v[i : i + 1] for k, v in data.items()}
        loss, _ = loss_fn(
            next_token_logprobs=parts_lp[i : i + 1],
            data=part,
            global_valid_seqs=seqs,
            global_valid_toks=toks,
        )
        total = total + loss
    torch.autograd.backward(total)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert full_lp.grad is not None
    assert parts_lp.grad is not None
    torch.testing.assert_close(parts_lp.grad, full_lp.grad)


def test_the_ratio_is_taken_against_prev_logprobs_not_generation_logprobs() -> None:
    data = _data()
    ntl = torch.tensor(V["next_token_logprobs"])
    seqs, toks = global_counts(data)
    base, _ = _nemo_default()(
        next_token_logprobs=ntl, data=data, global_valid_seqs=seqs, global_valid_toks=toks
    )
    moved = dict(data, generation_logprobs=data["generation_logprobs"] - 1.0)
    same, _ = _nemo_default()(
        next_token_logprobs=ntl, data=moved, global_valid_seqs=seqs, global_valid_toks=toks
    )
    assert same.item() == base.item()
    moved = dict(data, prev_logprobs=data["prev_logprobs"] - 1.0)
    other, _ = _nemo_default()(
        next_token_logprobs=ntl, data=moved, global_valid_seqs=seqs, global_valid_toks=toks
    )
    assert other.item() != base.item()


def test_a_wrapped_loss_equals_the_loss_it_wraps() -> None:
    torch.manual_seed(0)
    td = llm_batch(4, 8, vocab_size=64)
    policy = tiny_causal_lm()
    direct = PolicyLoss(policy, kl_coef=0.01)(td)
    d_grads = torch.autograd.grad(
        direct["loss_objective"] + direct["loss_kl_to_ref"], list(policy.parameters())
    )
    wrapped = NemoLossModule(ContractAsNemoLoss(lambda p: PolicyLoss(p, kl_coef=0.01)), policy)(td)
    w_grads = torch.autograd.grad(wrapped["loss_objective"], list(policy.parameters()))
    total = direct["loss_objective"] + direct["loss_kl_to_ref"]
    assert wrapped["loss_objective"].item() == pytest.approx(total.item(), abs=1e-6)
    for a, b in zip(d_grads, w_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_bad_calls_say_what_was_expected() -> None:
    data = _data()
    with pytest.raises(ValueError, match=r"next_token_logprobs: expected \[2, 5\]"):
        _nemo_default()(
            next_token_logprobs=torch.zeros(2, 6),
            data=data,
            global_valid_seqs=2,
            global_valid_toks=5,
        )
    with pytest.raises(ValueError, match="loss_type: expected 'token_level' or 'sequence_level'"):
        ContractAsNemoLoss(PolicyLoss, loss_type="token")
    bad: Any = None
    with pytest.raises(TypeError, match="expected next_token_logprobs= and data="):
        _nemo_default()(data=bad, global_valid_seqs=2, global_valid_toks=5)


_NO_NEMO = (
    "nemo_rl is not on the package index (0.0.0 placeholder); the vector pins its loss instead"
)


def test_real_clipped_pg_loss_where_nemo_rl_imports() -> None:
    losses = pytest.importorskip("nemo_rl.algorithms.loss.loss_functions", reason=_NO_NEMO)
    cfg = losses.ClippedPGLossConfig()
    real = losses.ClippedPGLossFn(cfg)
    data = _data()
    ntl = torch.tensor(V["next_token_logprobs"])
    seqs, toks = global_counts(data)
    want, _ = real(ntl, data, seqs, toks)
    got, _ = _nemo_default()(
        next_token_logprobs=ntl, data=data, global_valid_seqs=seqs, global_valid_toks=toks
    )
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    module = NemoLossModule(real, tiny_causal_lm())
    out = module(llm_batch(2, 6, vocab_size=64))
    assert torch.isfinite(out["loss_objective"])


@pytest.mark.parametrize(
    ("drop", "missing"),
    [
        (("advantages",), "['advantages']"),
        (("sample_mask",), "['sample_mask']"),
        (("token_mask",), "['token_mask']"),
        (("input_ids",), "['input_ids']"),
        (("prev_logprobs", "generation_logprobs"), "['prev_logprobs']"),
        (("input_ids", "advantages"), "['input_ids', 'advantages']"),
    ],
)
def test_missing_data_keys_are_named_with_what_nemo_rl_loss_data_holds(
    drop: tuple[str, ...], missing: str
) -> None:
    data = {k: v for k, v in _data().items() if k not in drop}
    with pytest.raises(NemoFormatError) as refused:
        _nemo_default()(
            next_token_logprobs=torch.tensor(V["next_token_logprobs"]),
            data=data,
            global_valid_seqs=2,
            global_valid_toks=5,
        )
    message = str(refused.value)
    assert message.startswith(f"data: missing {missing}; NeMo-RL's loss data holds input_ids")
    assert f"found {sorted(data)}" in message


# ---- every ClippedPGLossConfig key, against NeMo-RL's own ClippedPGLossFn ----------------

OPTS = json.loads((DATA / "nemo_rl_clipped_pg_options.json").read_text())


def _case_data(case: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {k: torch.tensor(v, dtype=dtype) for k, v in case["data"].items()}
    out["input_ids"] = out["input_ids"].long()
    out["token_mask"] = out["token_mask"].long()
    return out


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * max(1.0, abs(want))


def test_every_clipped_pg_config_key_has_three_non_default_vectors() -> None:
    assert OPTS["config_keys"] == list(CLIPPED_PG_DEFAULTS)
    for key, default in CLIPPED_PG_DEFAULTS.items():
        cases = [c for c in OPTS["cases"] if c["key"] == key]
        assert len(cases) >= 3, key
        # reference_policy_kl_penalty: 1.0 (the base of every case) is itself non-default.
        assert all(c["config"].get(key, 1.0) != default for c in cases), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_clipped_pg_options_reproduce_nemo_rl_loss_metrics_and_gradient(
    dtype: torch.dtype,
) -> None:
    # float64 within 1e-6 (relative above 1); float32 rounding within 1e-5.
    rel = 1e-6 if dtype == torch.float64 else 1e-5
    wrong: list[str] = []
    for case in OPTS["cases"]:
        ntl = torch.tensor(case["next_token_logprobs"], dtype=dtype, requires_grad=True)
        loss, metrics = clipped_pg_loss(case["config"])(
            next_token_logprobs=ntl,
            data=_case_data(case, dtype),
            global_valid_seqs=torch.tensor(case["global_valid_seqs"]),
            global_valid_toks=torch.tensor(case["global_valid_toks"]),
        )
        torch.autograd.backward(loss)
        assert ntl.grad is not None
        got = {"loss": loss.item(), **{k: metrics.get(k, math.nan) for k in case["metrics"]}}
        want = {"loss": case["loss"], **case["metrics"]}
        off = [k for k in want if not _close(got[k], want[k], rel)]
        grad_err = (ntl.grad.double() - torch.tensor(case["grad_next_token_logprobs"])).abs()
        if float(grad_err.max()) > rel:
            off.append(f"grad (max error {float(grad_err.max()):.2e})")
        if off:
            wrong.append(f"{case['key']} {case['config']}: {off[:5]}")
    assert not wrong, f"{len(wrong)} of {len(OPTS['cases'])} cases differ: {wrong[:5]}"


def test_async_grpo_reads_token_mult_prob_error_and_kl_penalty() -> None:
    case = next(c for c in OPTS["cases"] if c["key"] == "use_importance_sampling_correction")
    _, metrics = clipped_pg_loss({"use_importance_sampling_correction": True})(
        next_token_logprobs=torch.tensor(case["next_token_logprobs"], dtype=torch.float64),
        data=_case_data(case, torch.float64),
        global_valid_seqs=torch.tensor(case["global_valid_seqs"]),
        global_valid_toks=torch.tensor(case["global_valid_toks"]),
    )
    assert {"token_mult_prob_error", "kl_penalty", "sampling_importance_ratio"} <= set(metrics)


def test_clipped_pg_options_refuse_what_nemo_rl_refuses() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['ratio_clip'\]"):
        clipped_pg_options({"ratio_clip": 0.2})
    with pytest.raises(ValueError, match="needs token_level_loss=False"):
        clipped_pg_options({"sequence_level_importance_ratios": True})
    with pytest.raises(ValueError, match="needs use_importance_sampling_correction=True"):
        clipped_pg_options(
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2}
        )
    with pytest.raises(ValueError, match="use_cispo: needs a token ratio"):
        clipped_pg_options({"use_cispo": True, "ratio_clip_c": 3.0})
    with pytest.raises(ValueError, match="use_cispo: needs a token ratio"):
        clipped_pg_options({"use_cispo": True, "disable_ppo_ratio": True})


@pytest.mark.parametrize(
    "cfg",
    [
        {"use_importance_sampling_correction": True, "ratio_clip_c": 3.0},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
    ],
    ids=["is-dual-clip", "gspo"],
)
def test_round_trip_of_an_option_loss_equals_the_loss(cfg: dict[str, Any]) -> None:
    # posttrain loss -> NeMo-RL LossFunction -> LossModuleV1: the same numbers.
    torch.manual_seed(0)
    td = llm_batch(4, 8, vocab_size=64)
    policy = tiny_causal_lm()
    opts, _ = clipped_pg_options(cfg)
    # A layout batch's behaviour log-probs are the generation ones.
    direct = PolicyLoss(policy, replace(opts, generation_key=None))(td)
    total = sum(v for k, v in direct.items() if k.startswith("loss_"))
    wrapped = NemoLossModule(clipped_pg_loss(cfg), policy)(td)
    assert wrapped["loss_objective"].item() == pytest.approx(float(total.detach()), abs=1e-6)
    assert wrapped["token_mult_prob_error"].item() == pytest.approx(1.0, abs=1e-6)


def test_sequence_sampling_importance_ratio_counts_sample_mask_as_nemo_rl_does() -> None:
    # NeMo-RL 7ea279a, ClippedPGLossFn.__call__: masked_mean(weights [B, 1], sample_mask [B],
    # global_normalization_factor=global_valid_seqs) = sum(weights) x sum(sample_mask) /
    # global_valid_seqs. Row 1 is sampled but holds no token: NeMo-RL multiplies by 4 sampled
    # rows, a port multiplying by the 3 rows with a token reads 3/4 of its value.
    case = next(c for c in OPTS["cases"] if c["key"] == "sequence_level_importance_ratios")
    data = _case_data(case, torch.float64)
    data["token_mask"][1] = 0
    sm = data["sample_mask"]
    mask = data["token_mask"][:, 1:] * sm[:, None]
    diff = data["prev_logprobs"][:, 1:] - data["generation_logprobs"][:, 1:]
    weights = (diff * mask).sum(-1).exp()
    n_seq = sm.sum()
    nemo_rl = float(weights.sum() * sm.sum() / n_seq)
    with_tokens = float((mask.sum(-1) > 0).sum())
    assert (float(sm.sum()), with_tokens) == (4.0, 3.0)
    _, metrics = clipped_pg_loss(case["config"])(
        next_token_logprobs=torch.tensor(case["next_token_logprobs"], dtype=torch.float64),
        data=data,
        global_valid_seqs=n_seq,
        global_valid_toks=mask.sum(),
    )
    assert metrics["sampling_importance_ratio"] == pytest.approx(nemo_rl, rel=1e-9)
    assert nemo_rl == pytest.approx(4.3840539, rel=1e-6)  # rows with a token only: 3.2880405


def test_the_nemo_rl_metrics_are_the_adapters_not_the_losss() -> None:
    # PolicyLoss returns loss terms and the contract's diagnostics; NeMo-RL's metric set is
    # computed by clipped_pg_metrics beside it, from the same options.
    case = next(c for c in OPTS["cases"] if c["key"] == "use_importance_sampling_correction")
    loss_fn = clipped_pg_loss(case["config"])
    _, metrics = loss_fn(
        next_token_logprobs=torch.tensor(case["next_token_logprobs"], dtype=torch.float64),
        data=_case_data(case, torch.float64),
        global_valid_seqs=torch.tensor(case["global_valid_seqs"]),
        global_valid_toks=torch.tensor(case["global_valid_toks"]),
    )
    td = llm_batch(2, 6, vocab_size=64)
    own = loss_fn.make_loss(tiny_causal_lm())
    opts = replace(own.options, generation_key=None)
    out = PolicyLoss(tiny_causal_lm(), opts)(td)
    nemo_only = {"token_mult_prob_error", "probs_ratio", "kl_penalty", "sampling_importance_ratio"}
    assert nemo_only <= set(metrics)
    assert not nemo_only & set(out.keys())
    with pytest.raises(TypeError, match="nemo_metrics: not a PolicyLossOptions field"):
        PolicyLoss(tiny_causal_lm(), nemo_metrics=True)
