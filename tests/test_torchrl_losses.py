"""TorchRL's LLM losses through the loss suite: raw deviations found, ContractLoss conforms."""

from __future__ import annotations

import pytest

from posttrain.adapters.torchrl.deviations import LOSS_DEVIATIONS, Deviation
from posttrain.adapters.torchrl.implementations import LOSSES
from posttrain.conformance import Status, run

# What TorchRL 0.14.1 really does; a change upstream changes these sets and this test says so.
RAW_TOKEN_MEAN = {"LOSS-005", "LOSS-008", "LOSS-009", "LOSS-012"}
RAW_PROMPT_MEAN = {"LOSS-001", "LOSS-008", "LOSS-009"}  # shape [1] blocks the rest
RAW_TOKEN_MEAN_KL = RAW_TOKEN_MEAN | {"LOSS-010"}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_torchrl_losses(name: str) -> None:
    rep = run(LOSSES[name])
    rows = [r for r in rep.results if r.status in (Status.FAIL, Status.ERROR)]
    failing = {r.id for r in rows if "blocked by" not in r.message}
    if "-adapted-" in name:
        assert not failing, [r.message for r in rows]
    else:
        want = (
            RAW_PROMPT_MEAN
            if name.endswith("seq-mean-token-mean")
            else RAW_TOKEN_MEAN_KL
            if name.endswith("-kl")
            else RAW_TOKEN_MEAN
        )
        assert failing == want, [r.message for r in rows]


@pytest.mark.parametrize("deviation", LOSS_DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_loss_repro_still_reproduces(deviation: Deviation) -> None:
    exec(compile(deviation.repro, f"<repro {deviation.title}>", "exec"), {})
