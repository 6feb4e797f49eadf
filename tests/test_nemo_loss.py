"""NeMo-RL losses both ways (posttrain.adapters.nemo_rl.loss) against NeMo-RL's own vector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.adapters.nemo_rl.loss import ContractAsNemoLoss, NemoLossModule, global_counts
from posttrain.adapters.nemo_rl.train_data import NemoFormatError
from posttrain.reference_impls import PolicyGradientLoss
from posttrain.testing import llm_batch, tiny_causal_lm

V = json.loads((Path(__file__).resolve().parent / "data" / "nemo_rl.json").read_text())[
    "clipped_pg_loss"
]


def _data() -> dict[str, torch.Tensor]:
    d = V["data"]
    out = {k: torch.tensor(v, dtype=torch.float32) for k, v in d.items()}
    out["input_ids"] = out["input_ids"].long()
    out["token_mask"] = out["token_mask"].long()
    return out


def _nemo_default() -> ContractAsNemoLoss:
    # NeMo-RL's default ClippedPGLossConfig: ratio clip 0.2/0.2, k3 KL to reference 0.01,
    # token-level loss.
    return ContractAsNemoLoss(lambda p: PolicyGradientLoss(p, clip_epsilon=0.2, kl_coef=0.01))


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
        lambda p: PolicyGradientLoss(
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
    direct = PolicyGradientLoss(policy, kl_coef=0.01)(td)
    d_grads = torch.autograd.grad(
        direct["loss_objective"] + direct["loss_kl_to_ref"], list(policy.parameters())
    )
    wrapped = NemoLossModule(
        ContractAsNemoLoss(lambda p: PolicyGradientLoss(p, kl_coef=0.01)), policy
    )(td)
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
        ContractAsNemoLoss(PolicyGradientLoss, loss_type="token")
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
