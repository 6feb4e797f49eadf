"""TorchRL's weight transports through the weight-sync suite: raw deviations found, CheckedSender conforms."""

from __future__ import annotations

import dataclasses
import runpy
import threading
import time

import pytest
import torch

from posttrain.adapters.torchrl.deviations import WEIGHT_SYNC_DEVIATIONS, Deviation
from posttrain.adapters.torchrl.implementations import WEIGHT_SYNCS
from posttrain.adapters.torchrl.weight_sync import weight_sync_pair
from posttrain.conformance import Status
from posttrain.conformance.runner import Session, run
from posttrain.testing import tiny_causal_lm

# What TorchRL 0.14.1 really does; a change upstream changes this set and this test says so.
RAW = {"WS-004", "WS-005", "WS-006"}


@pytest.mark.parametrize("name", sorted(WEIGHT_SYNCS))
def test_torchrl_weight_sync(name: str) -> None:
    rep = run(WEIGHT_SYNCS[name])
    rows = [r for r in rep.results if r.status in (Status.FAIL, Status.ERROR)]
    failing = {r.id for r in rows}
    if "-adapted-" in name:
        assert not failing, [r.message for r in rows]
        assert rep.ok
    else:
        assert failing == WEIGHT_SYNCS[name].known_failures == RAW, [r.message for r in rows]
        ws004 = next(r.message for r in rows if r.id == "WS-004")
        assert "the receiver's model changed" in ws004  # half-written, not only unnamed
        if name.endswith("multiprocess"):
            assert "TimeoutError" in ws004  # send() never returns


@pytest.mark.parametrize("name", sorted(WEIGHT_SYNCS))
def test_applies_on_send_is_declared_because_torchrl_writes_on_send(name: str) -> None:
    # Without the declaration WS-002 sees the sent weights in the model before receive():
    # the capability is what TorchRL does, not a blanket waiver.
    impl = WEIGHT_SYNCS[name]
    assert "applies_on_send" in impl.capabilities
    undeclared = dataclasses.replace(
        impl, capabilities=frozenset(impl.capabilities) - {"applies_on_send"}
    )
    session = Session(undeclared)
    row = session.run_one(session.contract.requirement("WS-002"))
    assert row.status is Status.FAIL
    assert "before a receive(): receiver.version is 0 but the model holds the weights of " in (
        row.message
    )


def test_a_dropped_pair_stops_torchrl_s_polling_thread() -> None:
    sender, receiver = weight_sync_pair(tiny_causal_lm(), "shared_mem", adapted=True)
    sender.send(tiny_causal_lm(seed=1).state_dict(), version=1)
    del sender, receiver
    time.sleep(0.2)
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.3  # no busy background receiver left behind


def test_adapted_send_is_all_or_nothing_and_names_the_parameter() -> None:
    # Threads other tests left (a timed-out TorchRL send finishing late) are not this test's.
    earlier = set(threading.enumerate())
    model = tiny_causal_lm()
    sender, receiver = weight_sync_pair(model, "shared_mem", adapted=True)
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        bad = {k: torch.randn_like(v) for k, v in before.items()}
        del bad["model.norm.weight"]
        bad["lm_head.bias"] = torch.zeros(64)
        with pytest.raises(ValueError, match="weights rejected") as e:
            sender.send(bad, version=1)
        assert "model.norm.weight: missing" in str(e.value)
        assert "lm_head.bias: not a parameter or buffer of the model" in str(e.value)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        receiver.receive()
        assert receiver.version == 0
    finally:
        receiver.close()
        receiver.close()  # a second close is a no-op
    assert not [
        t
        for t in threading.enumerate()
        if t.name.startswith("posttrain-")
        and not t.name.startswith("posttrain-check-")
        and t not in earlier
    ]


@pytest.mark.parametrize(
    "deviation",
    WEIGHT_SYNC_DEVIATIONS,
    ids=lambda d: "-".join(d.requirements) + "-" + d.component.split()[0],
)
def test_each_published_weight_sync_repro_still_reproduces(deviation: Deviation) -> None:
    runpy.run_path(str(deviation.path), run_name="__main__")  # as `python <repro>` runs it
