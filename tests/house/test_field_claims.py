"""Every framework-behaviour sentence of the loss pages, checked against the cited code.

Each test runs the function a sentence of docs/loss.md, docs/verl.md, docs/reports/losses.md
or the spec's count mapping (posttrain/contracts/mapping.py) cites, at the pinned release,
where it is installed (verl 0.9.1, TRL 1.16, OpenRLHF 0.11.2), and checks the sentence's
number. NeMo-RL's sentences are checked in tests/adapters/nemo_rl/test_loss.py against vectors of its own
code.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts
from posttrain.testing import llm_batch, tiny_causal_lm

K = LLM_LAYOUT_V1.key


def _core_algos() -> Any:
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason="pip install --no-deps verl")


# ---- verl 0.9.1 -------------------------------------------------------------------------


def test_verl_seq_mean_token_sum_norm_divides_by_the_width_when_loss_scale_factor_is_unset() -> (
    None
):
    # docs/verl.md, docs/reports/losses.md: agg_loss (verl/trainer/ppo/core_algos.py) divides
    # seq-mean-token-sum-norm by loss_mask.shape[-1] when loss_scale_factor is None.
    agg_loss = _core_algos().agg_loss
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    pad = torch.zeros(2, 3)
    narrow = agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")
    wide = agg_loss(
        torch.cat([loss_mat, pad], 1), torch.cat([mask, pad], 1), "seq-mean-token-sum-norm"
    )
    assert float(narrow) == pytest.approx((6 + 9) / 2 / 4)
    assert float(narrow / wide) == pytest.approx(7 / 4)  # 3 padding columns: width 4 -> 7
    fixed = agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=16)
    fixed_wide = agg_loss(
        torch.cat([loss_mat, pad], 1),
        torch.cat([mask, pad], 1),
        "seq-mean-token-sum-norm",
        loss_scale_factor=16,
    )
    assert float(fixed) == pytest.approx(float(fixed_wide))


def test_verl_counts_a_row_without_response_tokens_when_the_trainer_passes_the_batch_size() -> None:
    # mapping.py: the trainer passes global_batch_size = ppo_mini_batch_size x rollout.n
    # (RayPPOTrainer._update_actor); agg_loss's seq_mask rule applies only when it is None.
    # ray_trainer.py imports torchdata and ray (not installed with --no-deps): read its text.
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("verl")
    assert spec is not None
    assert spec.submodule_search_locations
    text = (
        Path(next(iter(spec.submodule_search_locations))) / "trainer" / "ppo" / "ray_trainer.py"
    ).read_text()
    src = text.split("    def _update_actor(")[1].split("\n    def ")[0]
    assert "ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n" in src
    assert "global_batch_size=ppo_mini_batch_size" in src
    agg_loss = _core_algos().agg_loss
    loss_mat = torch.tensor([[1.0, 3.0], [2.0, 2.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # row 2 holds no token
    fallback = agg_loss(loss_mat, mask, "seq-mean-token-mean")
    as_trained = agg_loss(loss_mat, mask, "seq-mean-token-mean", global_batch_size=3)
    assert float(fallback) == pytest.approx((2 + 2) / 2)  # seq_mask: 2 rows
    assert float(as_trained) == pytest.approx((2 + 2) / 3)  # every row of the mini-batch


# ---- TRL 1.16 -----------------------------------------------------------------------------


def _first_token_weight(loss: Any, td: Any) -> float:
    from posttrain.conformance.suites.loss_kit import logp_grads as _logp_grads

    _, g = _logp_grads(loss.policy if hasattr(loss, "policy") else loss.inner.policy, loss, td)
    first = td.get(K("assistant_mask"))[0].nonzero()[0, 0]
    return -float(g[0, first])


def _on_policy_batch(policy: Any) -> Any:
    from posttrain.contracts.alignment import token_log_probs

    td = llm_batch(3, 10, vocab_size=64, seed=3)
    with torch.no_grad():
        lp = token_log_probs(
            policy(
                input_ids=td.get(K("tokens")),
                attention_mask=td.get(K("attention_mask")).long(),
            ).logits,
            td.get(K("tokens")),
        )
    td.set(K("sample_log_probs"), torch.where(td.get(K("assistant_mask")), lp, 0.0))
    td.set(K("advantage"), torch.ones(3))
    return td


def test_trl_cispo_clamps_the_weight_at_epsilon_high_itself() -> None:
    # docs/loss.md: GRPOTrainer._compute_loss computes clamp(coef_1, max=self.epsilon_high);
    # unset, epsilon_high is epsilon, 0.2: every weight at ratio 1 becomes 0.2.
    pytest.importorskip("trl", reason="pip install trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    from posttrain.adapters.trl.loss import TRLGRPOLoss, grpo_trainer

    assert "torch.clamp(coef_1, max=self.epsilon_high)" in inspect.getsource(
        GRPOTrainer._compute_loss
    )
    assert grpo_trainer("cispo").epsilon_high == pytest.approx(0.2)
    policy = tiny_causal_lm(vocab_size=64, seed=0)
    td = _on_policy_batch(policy)
    default = TRLGRPOLoss(policy, "cispo")
    recommended = TRLGRPOLoss(policy, "cispo", epsilon_high=5.0)
    ratio = _first_token_weight(default, td) / _first_token_weight(recommended, td)
    assert ratio == pytest.approx(0.2, rel=1e-4)


@pytest.mark.parametrize(
    ("loss_type", "adds_up"), [("bnpo", False), ("grpo", False), ("dapo", True)]
)
def test_trl_counts_through_num_items_in_batch_alone(loss_type: str, adds_up: bool) -> None:
    # docs/reports/losses.md: with counts passed only as num_items_in_batch, bnpo and grpo
    # micro-batches do not add up to the whole batch (LOSS-017); dapo's do.
    pytest.importorskip("trl", reason="pip install trl")
    from posttrain.adapters.trl.implementations import TRLAsUsersRunIt

    policy = tiny_causal_lm(vocab_size=64, seed=0)
    td = _on_policy_batch(policy)
    loss = TRLAsUsersRunIt(policy, loss_type)
    whole = GlobalCounts.of(td)
    one = float(loss(td, counts=whole)["loss_objective"])
    parts = sum(float(loss(td[idx], counts=whole)["loss_objective"]) for idx in ([0], [1, 2]))
    assert (abs(parts - one) <= 1e-5 * max(1.0, abs(one))) is adds_up


# ---- OpenRLHF 0.11.2 ----------------------------------------------------------------------


def test_openrlhf_replay_buffer_counts_rows_with_an_action_token() -> None:
    # docs/reports/losses.md: OpenRLHF's replay buffer all-reduces the tokens and the rows
    # whose action_mask holds a token; its loss divides by them (masked loss sum).
    from importlib import metadata
    from pathlib import Path

    pytest.importorskip("posttrain.adapters.openrlhf.loss")
    try:
        dist = metadata.distribution("openrlhf")
    except metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps openrlhf==0.11.2")
    root = Path(str(dist.locate_file("openrlhf")))
    buffer = (root / "trainer" / "ppo_utils" / "replay_buffer.py").read_text()
    assert "int(self.items[idx].action_mask.sum().item() > 0)" in buffer
    from posttrain.adapters.openrlhf.loss import openrlhf_loss_module

    aggregate_loss = openrlhf_loss_module().aggregate_loss
    loss = torch.tensor([[1.0, 3.0], [2.0, 2.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # row 2 holds no token
    got = aggregate_loss(loss, mask, token_level_loss=False, global_batch_size=2.0)
    assert float(got) == pytest.approx((2 + 2) / 2, rel=1e-6)
