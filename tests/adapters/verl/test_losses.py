"""verl 0.9.1's registered policy losses through the loss suite: a deterministic slice of the
rows (the whole field runs in `make losses-report`), each failing exactly what it declares."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="pip install --no-deps verl==0.9.1")

from posttrain.adapters.verl.implementations import KNOWN, MODES, ROWS
from tests.outcomes import own_failures

SLICE = [
    "verl-raw-vanilla-token-mean",
    "verl-raw-vanilla-seq-mean-token-mean",
    "verl-adapted-vanilla-token-mean",
    "verl-adapted-vanilla-seq-mean-token-mean",
    "verl-adapted-vanilla-seq-mean-token-sum",
    "verl-adapted-vanilla-seq-mean-token-sum-norm",
    "verl-adapted-gspo-seq-mean-token-mean",
    "verl-adapted-gpg-token-mean",
    "verl-adapted-kl-cov-token-mean",
    "verl-adapted-dro-token-mean",
    "verl-adapted-sapo-token-mean",
    "verl-adapted-geo-mean-token-mean",
    "verl-adapted-bypass-mode-token-mean",
]


@pytest.mark.parametrize("name", SLICE)
def test_verl_row_fails_what_it_declares(name: str) -> None:
    assert set(own_failures(ROWS[name])) == set(KNOWN.get(name, frozenset()))


def test_every_registered_loss_has_a_row_in_every_aggregation() -> None:
    from posttrain.adapters.verl.loss import core_algos

    assert set(MODES) == set(core_algos().POLICY_LOSS_REGISTRY)
    assert len(ROWS) == len(MODES) * 4 * 2


def test_global_counts_reach_verl_as_batch_num_tokens_and_global_batch_size() -> None:
    # The adapter's loss of a micro-batch given the whole batch's counts is verl's agg_loss of
    # that micro-batch with batch_num_tokens / global_batch_size set to them.
    import torch

    from posttrain.adapters.verl.loss import VerlLoss, core_algos
    from posttrain.contracts.alignment import token_log_probs
    from posttrain.contracts.loss import GlobalCounts
    from posttrain.testing import llm_batch, tiny_causal_lm

    policy = tiny_causal_lm(vocab_size=64)
    td = llm_batch(6, 10, vocab_size=64)
    k = "tokens", "full"
    with torch.no_grad():
        own = token_log_probs(policy(input_ids=td.get(k)).logits, td.get(k))
    td.set(("log_probs", "full"), own)
    td.set("advantage", torch.linspace(-1.0, 1.0, 6))
    whole = GlobalCounts.of(td)
    part = td[:2]
    mask = part.get(("masks", "all_assistant_mask")).clone()
    mask[:, 0] = False
    for agg, mode in (("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean")):
        loss = VerlLoss(policy, "vanilla", agg)
        with torch.no_grad():
            got = float(loss(part, counts=whole)["loss_objective"])
        pg = -part.get("advantage")[:, None] * torch.ones_like(own[:2])
        want = float(
            core_algos().agg_loss(
                pg,
                mask,
                mode,
                batch_num_tokens=whole.tokens,
                global_batch_size=whole.sequences,
            )
        )
        assert got == pytest.approx(want, rel=1e-5)


def _in_verl_source(name: str, src: str) -> bool:
    """A verl metric name is in verl's source: quoted whole, or a tail of it quoted (or after an
    f-string's ``{...}/``) with the rest as a prefix verl adds (``actor/`` + ``"kl_loss"``,
    ``timing_s/`` + a timer named ``"gen"``)."""
    import re

    parts = name.split("/")
    for k in range(len(parts)):
        tail, head = "/".join(parts[k:]), "/".join(parts[:k])
        quoted = re.search(rf"[\"']{re.escape(tail)}[\"']", src) or re.search(
            rf"f[\"'][^\"'\n]*\{{[^}}]+\}}/{re.escape(tail)}[\"']", src
        )
        if quoted and (not head or f"{head}/" in src or f'"{head}"' in src):
            return True
    return False


def test_the_metric_crosswalks_verl_names_are_verls() -> None:
    # Each verl name the metric catalogue maps to is read from verl 0.9.1's own source.
    import pathlib
    import re

    import verl

    from posttrain.contracts.catalogue import CATALOGUE_V1

    root = pathlib.Path(verl.__file__).parent
    src = "\n".join(
        p.read_text(errors="ignore") for p in root.rglob("*.py") if "tests" not in p.parts
    )
    names = [
        n
        for m in CATALOGUE_V1.metrics
        for n in re.findall(r"\b[a-z_]+(?:/[a-z0-9_]+)+", (m.crosswalk or {}).get("verl", ""))
    ]
    assert len(names) >= 30
    assert [n for n in names if not _in_verl_source(n, src)] == []
    assert not _in_verl_source("critic/score/mena", src)  # a misspelt name is caught


def test_verl_users_row_at_verl_default_loss_scale_factor_fails_what_it_declares() -> None:
    from posttrain.adapters.verl.implementations import USERS_ROWS

    row = USERS_ROWS["verl-users-vanilla-seq-mean-token-sum-norm"]
    assert {"LOSS-003", "LOSS-005"} <= set(row.known_failures)
    assert set(own_failures(row)) == set(row.known_failures)
