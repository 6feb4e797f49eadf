"""The conformance kit, tested from outside on generation, rollout and weight_sync.

Every implementation in ``tests/independent/{generation,rollouts,weight_syncs}.py`` was written
from the specs alone, without the suites or the reference implementations. The correct ones
must conform; each one-bug variant must fail the requirement its docstring names. Where the
kit's verdict disagrees with the spec sentence, the case is an ``xfail(strict=True)`` whose
reason starts with "kit defect", and a plain test next to it shows the bug is real.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import time
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from posttrain.conformance import Report, Status
from posttrain.conformance.runner import run
from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY
from posttrain.testing import forced_token_weights, tiny_causal_lm
from tests.independent import generation, rollouts, weight_syncs
from tests.independent_kit import assert_conforms, kit_params
from tests.outcomes import run_for

_TIMEOUT_S = 60.0  # per requirement: a hang is a failed row, never a stalled run

CORRECT: dict[str, Implementation] = {
    **{f"generation/{k}": v for k, v in generation.CORRECT_GENERATION.items()},
    **{f"rollout/{k}": v for k, v in rollouts.CORRECT_ROLLOUT.items()},
    **{f"weight_sync/{k}": v for k, v in weight_syncs.CORRECT_WEIGHT_SYNC.items()},
}
BUGGY: dict[str, tuple[Implementation, str]] = {
    **{f"generation/{k}": v for k, v in generation.BUGGY_GENERATION.items()},
    **{f"rollout/{k}": v for k, v in rollouts.BUGGY_ROLLOUT.items()},
    **{f"weight_sync/{k}": v for k, v in weight_syncs.BUGGY_WEIGHT_SYNC.items()},
}

# Cases where the kit does not report the requirement the spec sentence says is broken (none
# today). The tests at the end show, without the kit, that each former case's bug is real.
KIT_DEFECTS: dict[str, str] = {}


@functools.cache
def _report(key: str) -> Report:
    impl = CORRECT[key] if key in CORRECT else BUGGY[key][0]
    return run(impl, timeout_s=_TIMEOUT_S)


@functools.cache
def _buggy_report(key: str) -> Report:
    """The run of the requirement the variant breaks and its foundations only."""
    impl, expected = BUGGY[key]
    return run_for(impl, expected, timeout_s=_TIMEOUT_S)


def _own_failures(rep: Report) -> dict[str, str]:
    """FAIL/ERROR rows that are not merely 'blocked by' another id: id -> message."""
    return {
        r.id: r.message
        for r in rep.results
        if r.status in (Status.FAIL, Status.ERROR) and "blocked by" not in r.message[:40]
    }


def _params(keys: list[str]) -> list[Any]:
    return kit_params(keys, KIT_DEFECTS)


@pytest.mark.parametrize("key", _params(list(CORRECT)))
def test_correct_implementation_conforms(key: str) -> None:
    rep = _report(key)
    assert_conforms(key, rep)


@pytest.mark.parametrize("key", _params(list(BUGGY)))
def test_buggy_variant_fails_its_requirement(key: str) -> None:
    expected = BUGGY[key][1]
    rep = _buggy_report(key)
    own = _own_failures(rep)
    assert expected in own, f"{key}: expected {expected} to fail, kit's own failures: {sorted(own)}"


def test_every_buggy_variant_is_caught_somewhere() -> None:
    """Whatever the id, the kit says no to every buggy variant."""
    passed = sorted(k for k in BUGGY if not _own_failures(_buggy_report(k)))
    assert passed == []


def test_rejections_not_blamed_for_a_version_that_never_moved() -> None:
    own = _own_failures(_report("weight_sync/version_not_bumped"))
    assert "WS-002" in own
    assert not {"WS-004", "WS-005", "WS-006"} & set(own), {k: own[k] for k in own if k != "WS-002"}


# ---- the kit-defect cases' bugs, shown without the kit ----------------------------------------


def _eos_model() -> Any:
    """A tiny Llama whose next token depends on the last one only: 9 -> EOS, anything -> 7."""
    m = tiny_causal_lm()
    w = forced_token_weights(m, 7)
    w["model.embed_tokens.weight"][9] = 0.0
    w["model.embed_tokens.weight"][9, 1] = 1.0
    w["lm_head.weight"][2, 1] = 50.0
    m.load_state_dict(w)
    return m


def test_pad_after_eos_breaks_gen_003() -> None:
    # two servers: one server would answer the second time from its response cache
    srv, srv2 = (generation.PadAfterEosServer(_eos_model(), max_new_tokens=3) for _ in "ab")
    try:
        req = TensorDict({PROMPT_KEY: torch.tensor([5, 9])}, [])
        alone = srv.client().submit(req).result(timeout=30)[RESPONSE_KEY].tolist()
        other = TensorDict({PROMPT_KEY: torch.tensor([5, 6])}, [])
        futs = [srv2.client().submit(r) for r in (req, other)]  # one batch: 10 ms linger
        cf.wait(futs, timeout=30)
        batched = futs[0].result(timeout=1)[RESPONSE_KEY].tolist()
    finally:
        srv.shutdown()
        srv2.shutdown()
    assert alone == [2]
    assert batched == [2, 0, 0]  # GEN-003: not the same tokens as served alone


def test_correct_server_keeps_eos_rows_alone_and_batched() -> None:
    srv = generation.DrainBatchingServer(_eos_model(), max_new_tokens=3)
    try:
        req = TensorDict({PROMPT_KEY: torch.tensor([5, 9])}, [])
        other = TensorDict({PROMPT_KEY: torch.tensor([5, 6])}, [])
        futs = [srv.client().submit(r) for r in (req, other)]
        got = [f.result(timeout=30)[RESPONSE_KEY].tolist() for f in futs]
    finally:
        srv.shutdown()
    assert got == [[2], [7, 7, 7]]


def test_eos_as_pad_breaks_roll_001() -> None:
    k = LLM_LAYOUT_V1.key
    prompts = [[5, 9], [5, 6]]
    bad = next(iter(rollouts.EosAsPadSource(_eos_model(), prompts, 1, max_new_tokens=3)))
    good = next(iter(rollouts.EagerPrefetchSource(_eos_model(), prompts, 1, max_new_tokens=3)))
    assert good.get(k("tokens"))[0].tolist() == [5, 9, 2, 0, 0]
    assert good.get(k("assistant_mask"))[0].tolist() == [False, False, True, False, False]
    # the generated EOS at position 2 is neither a real token nor trained on
    assert bad.get(k("attention_mask"))[0].tolist() == [True, True, False, False, False]
    assert bad.get(k("assistant_mask"))[0].tolist() == [False] * 5


def test_stamp_at_yield_breaks_roll_003() -> None:
    policy = tiny_causal_lm()
    old = next(iter(rollouts.LazyGeneratorSource(tiny_causal_lm(), [[5, 6]], 1, max_new_tokens=3)))
    src = rollouts.StampAtYieldSource(policy, [[5, 6]], 2, max_new_tokens=3)
    it = iter(src)
    next(it)  # the second batch is prefetched now, by version 0's weights
    src.update_policy_weights_(forced_token_weights(policy, 42))
    second = next(it)
    src.shutdown()
    k = LLM_LAYOUT_V1.key
    assert second.get(k("policy_version")).tolist() == [1, 1]  # stamped with the new version
    assert (
        second.get(k("tokens"))[0, 2:].tolist() == old.tensordicts[0].get(k("tokens"))[2:].tolist()
    )


def test_stale_stamp_breaks_roll_003() -> None:
    policy = tiny_causal_lm()
    src = rollouts.StaleStampSource(policy, [[5, 6]], 3, max_new_tokens=2)
    it = iter(src)
    next(it)
    src.update_policy_weights_(forced_token_weights(policy, 42))
    batch = next(it)  # generated now, lazily, by version 1's weights
    item = batch.tensordicts[0]
    assert src.policy_version == 1
    assert item.get(LLM_LAYOUT_V1.key("tokens"))[2:].tolist() == [42, 42]
    assert int(item.get("policy_version")) == 0  # ROLL-003: not the version when generated


def test_params_only_breaks_ws_001() -> None:
    model = torch.nn.BatchNorm1d(3)  # persistent buffers: running_mean/var, num_batches_tracked
    tx, rx = weight_syncs.params_only_pair(model)
    w = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    tx.send(w, version=1)
    rx.receive(timeout=1.0)
    assert torch.equal(model.weight, w["weight"])
    assert not torch.equal(
        model.state_dict()["running_mean"], w["running_mean"]
    )  # WS-001: buffer not synced
    tx2, rx2 = weight_syncs.queue_pair(model2 := torch.nn.BatchNorm1d(3))
    tx2.send(w, version=1)
    rx2.receive(timeout=1.0)
    assert all(torch.equal(model2.state_dict()[k], w[k]) for k in w)


def test_left_padded_batch_meets_layout_v1() -> None:
    """The left-padded design's batch is valid layout v1 by the contracts' own validator, and
    the real tokens before the first assistant token are exactly the prompt."""
    k = LLM_LAYOUT_V1.key
    prompts = [[5, 6, 7], [10, 11, 12, 13]]
    src = rollouts.LeftPaddedSource(tiny_causal_lm(), prompts, 1, max_new_tokens=3)
    batch = next(iter(src))
    src.shutdown()
    assert [str(v) for v in LLM_LAYOUT_V1.violations(batch, deep=True)] == []
    for i, want in enumerate(p for p in prompts for _ in range(2)):
        attn, asst = batch.get(k("attention_mask"))[i], batch.get(k("assistant_mask"))[i]
        first = int(asst.nonzero()[0])
        assert batch.get(k("tokens"))[i, :first][attn[:first]].tolist() == want


def test_result_only_handle_answers_and_settles_on_shutdown() -> None:
    """What GEN-008 needs, through ``.result(timeout)`` alone: after shutdown returns, every
    handle answers at once, with a response or an error."""
    srv = generation.ResultOnlyServer(tiny_causal_lm(), max_new_tokens=4)
    replies = [
        srv.client().submit(TensorDict({PROMPT_KEY: torch.tensor([5 + i, 6])}, []))
        for i in range(16)
    ]
    srv.shutdown(timeout=5.0)
    settled = 0
    for r in replies:
        with contextlib.suppress(cf.CancelledError, RuntimeError, TimeoutError):
            r.result(timeout=0.5)
        settled += 1
    assert settled == 16


def test_declared_fail_but_drains_serves_pending_requests() -> None:
    """Shown without the kit: requests pending at ``shutdown`` are served although the
    declaration says they fail (the correct pool server cancels them)."""

    def pending_answers(srv: Any) -> int:
        slow = [
            srv.client().submit(TensorDict({PROMPT_KEY: torch.tensor([5 + i, 6])}, []))
            for i in range(24)
        ]
        srv.shutdown(timeout=10.0)
        return sum(1 for f in slow if f.done() and not f.cancelled() and f.exception() is None)

    model = tiny_causal_lm()
    model.register_forward_pre_hook(lambda *_: time.sleep(0.01))  # keep requests queued
    served_bug = pending_answers(generation.DrainingPoolServer(model, max_new_tokens=4))
    served_ok = pending_answers(generation.CancelPoolServer(model, max_new_tokens=4))
    assert served_bug == 24
    assert served_ok < 24
