"""posttrain's NLL and DPO losses against NeMo-RL's own NLLLossFn and DPOLossFn."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from posttrain.adapters.nemo_rl.loss import dpo_loss, nll_loss
from posttrain.contracts.loss import GlobalCounts
from posttrain.reference_impls import DPOLoss, NLLLoss
from posttrain.testing import llm_batch, tiny_causal_lm
from tests.paths import DATA

VEC = json.loads((DATA / "nemo_rl_nll_dpo.json").read_text())


def _data(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["data"].items()}
    out["input_ids"] = out["input_ids"].long()
    out["token_mask"] = out["token_mask"].long()
    return out


@pytest.mark.parametrize(
    "case", VEC["cases"], ids=lambda c: f"{c['kind']}-{'-'.join(c['config']) or 'default'}"
)
def test_nemo_rl_nll_and_dpo_vectors(case: dict[str, Any]) -> None:
    ntl = torch.tensor(case["next_token_logprobs"], dtype=torch.float64, requires_grad=True)
    fn = nll_loss() if case["kind"] == "nll" else dpo_loss(case["config"])
    loss, metrics = fn(
        ntl,
        _data(case),
        torch.tensor(case["global_valid_seqs"]),
        torch.tensor(case["global_valid_toks"]),
    )
    torch.autograd.backward(loss)
    assert ntl.grad is not None
    assert loss.item() == pytest.approx(case["loss"], abs=1e-6)
    for k, v in case["metrics"].items():
        assert metrics[k] == pytest.approx(v, abs=1e-6), k
    want = torch.tensor(case["grad_next_token_logprobs"], dtype=torch.float64)
    assert float((ntl.grad - want).abs().max()) < 1e-6


def _grads(policy: Any, out: Any) -> torch.Tensor:
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    return torch.cat([g.flatten() for g in torch.autograd.grad(total, list(policy.parameters()))])


@pytest.mark.parametrize(
    "make",
    [
        lambda p: NLLLoss(p),
        lambda p: NLLLoss(p, aggregation="seq_mean_token_mean"),
        lambda p: DPOLoss(p, beta=0.5, sft_weight=0.3, sft_average=True),
    ],
    ids=["nll-token-mean", "nll-seq-mean", "dpo-sft"],
)
def test_micro_batches_add_up_under_global_counts(make: Any) -> None:
    policy = tiny_causal_lm(vocab_size=64, seed=0)
    td = llm_batch(6, 10, vocab_size=64, seed=3)
    td.set(
        ("next", "ref_log_probs", "full"),
        torch.randn(6, 10, generator=torch.Generator().manual_seed(1)),
    )
    loss = make(policy)
    whole = _grads(policy, loss(td))
    parts = [td[:2], td[2:6]]  # whole pairs per micro-batch
    counts = GlobalCounts.of(td)
    acc = sum(_grads(policy, loss(p, counts=counts)) for p in parts)
    assert isinstance(acc, torch.Tensor)
    assert float((acc - whole).abs().max()) <= 1e-5 * float(whole.abs().max())


def test_options_are_validated_by_name() -> None:
    policy = tiny_causal_lm(vocab_size=64)
    with pytest.raises(ValueError, match="beta: expected a finite number >= 0"):
        DPOLoss(policy, beta=-1.0)
    with pytest.raises(ValueError, match=r"unknown keys \['beta'\]"):
        dpo_loss({"beta": 0.1})
    td = llm_batch(3, 8, vocab_size=64)
    td.set(("next", "ref_log_probs", "full"), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="expected an even number of rows"):
        DPOLoss(policy)(td)


def test_dpo_averages_over_pairs_when_a_rejected_row_is_empty() -> None:
    policy = tiny_causal_lm(vocab_size=64, seed=0)
    td = llm_batch(4, 8, vocab_size=64, seed=3)
    td.set(("next", "ref_log_probs", "full"), torch.zeros(4, 8))
    td["masks", "all_assistant_mask"][3] = False  # pair 1: chosen answer, empty rejected one
    assert GlobalCounts.of(td).sequences == 3  # rows with a token: one and a half pairs
    assert DPOLoss.counts(td) == GlobalCounts(GlobalCounts.of(td).tokens, 4)
    out = DPOLoss(policy, beta=0.1)(td)
    # Pair 1's rejected reward is 0 and its chosen one differs: accuracy is a share of 2 pairs.
    assert float(out["accuracy"]) in (0.0, 0.5, 1.0)
    explicit = DPOLoss(policy, beta=0.1)(td, counts=DPOLoss.counts(td))
    assert float(explicit["preference_loss"]) == pytest.approx(float(out["preference_loss"]))
