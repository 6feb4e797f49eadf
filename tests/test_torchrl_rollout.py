"""TorchRL's LLMCollector through the rollout suite: raw deviations found, ContractCollector conforms."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.adapters.torchrl import rollout
from posttrain.adapters.torchrl.deviations import ROLLOUT_DEVIATIONS, Deviation
from posttrain.adapters.torchrl.implementations import ADAPTED_LLM_COLLECTOR, RAW_LLM_COLLECTOR
from posttrain.conformance import Implementation, run
from tests.outcomes import own_failures


def test_raw_collector_fails_exactly_torchrl_s_deviations() -> None:
    failing = own_failures(RAW_LLM_COLLECTOR)
    assert set(failing) == RAW_LLM_COLLECTOR.known_failures == {"ROLL-004", "ROLL-008"}, failing
    assert "has no attribute 'data'" in failing["ROLL-004"]
    assert "sample_log_probs [0.0," in failing["ROLL-008"]


def test_adapted_collector_passes_every_applicable_requirement() -> None:
    rep = run(ADAPTED_LLM_COLLECTOR)
    assert rep.ok
    assert own_failures(ADAPTED_LLM_COLLECTOR) == {}


def test_the_root_version_stamp_lags_an_update() -> None:
    # The adapter stamps ("next", "policy_version"); TorchRL's root stamp fails ROLL-004.
    def root_stamped(*args: Any, **kwargs: Any) -> Any:
        src = rollout.llm_collector(*args, adapted=True, **kwargs)
        src.version_key = "policy_version"
        return src

    impl = Implementation("rollout", root_stamped, name="root-stamped", capabilities={"ragged"})
    assert own_failures(impl) == {
        "ROLL-004": "ROLL-004: stamps before the update [0], after [0]: they must rise "
        "(see specs/rollout-v1.md#ROLL-004)"
    }


def test_bad_weights_name_the_parameter_and_leave_the_collector_unchanged() -> None:
    import torch

    from posttrain.conformance.policy import tiny_causal_lm

    model = tiny_causal_lm()
    src = rollout.llm_collector(model, [[5, 6, 7]], None, max_new_tokens=2, adapted=True)
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        bad = {k: torch.zeros_like(v) for k, v in before.items()}
        name = "model.norm.weight"
        bad[name] = torch.zeros(3)
        with pytest.raises(
            ValueError, match=r"model\.norm\.weight: expected float32 \[32\], found float32 \[3\]"
        ):
            src.update_policy_weights_(bad)
        assert src.policy_version == 0
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    finally:
        src.shutdown()


@pytest.mark.parametrize("deviation", ROLLOUT_DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_rollout_repro_still_reproduces(deviation: Deviation) -> None:
    exec(compile(deviation.repro, f"<repro {deviation.title}>", "exec"), {})
