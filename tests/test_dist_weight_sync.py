"""TorchRL's DistributedWeightSyncScheme (gloo, loopback) across processes: raw and adapted
through the weight-sync suite, the receiving model in its own process."""

from __future__ import annotations

import pytest
import torch

from posttrain.adapters.nemo_rl.weight_sync import NemoWeightSynchronizer
from posttrain.adapters.torchrl.dist_weight_sync import dist_weight_sync_pair
from posttrain.adapters.torchrl.implementations import (
    ADAPTED_DIST_WEIGHT_SYNC,
    RAW_DIST_WEIGHT_SYNC,
)
from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.testing import tiny_causal_lm


def test_adapted_distributed_scheme_conforms_across_processes() -> None:
    rep = run(ADAPTED_DIST_WEIGHT_SYNC)
    rows = {r.id: r for r in rep.results}
    assert rep.ok, [r.message for r in rep.results if r.status is not Status.PASS]
    assert rows["WS-008"].status is Status.PASS


def test_raw_distributed_scheme_bad_weights_abort_the_receiving_process() -> None:
    # TorchRL 0.14.1 receives into the live parameters, checking byte sizes only: a wrong
    # shape, a wider dtype or a missing name kills the receiving process (SIGABRT, gloo).
    rep = run(RAW_DIST_WEIGHT_SYNC)
    bad = {r.id: r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)}
    assert set(bad) == rep.failed_ids() == {"WS-004", "WS-005", "WS-006"}, bad
    assert rep.surprises() == []  # what fails is what the row declares
    assert [m for m in bad.values() if "receiving process died (exit code -6)" not in m] == []


def test_a_new_pair_closes_the_previous_one_and_nemo_drives_it() -> None:
    first_sender, first = dist_weight_sync_pair(tiny_causal_lm(seed=0))
    trainer = tiny_causal_lm(seed=1)
    sender, receiver = dist_weight_sync_pair(tiny_causal_lm(seed=0), adapted=True)
    with pytest.raises(RuntimeError, match="was closed"):
        first.state_dict()  # one default process group per process: the first pair is gone
    sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver)
    sync.init_communicator()
    assert sync.sync_weights()["weight_version"] == 1
    got = receiver.state_dict()
    assert all(torch.equal(got[k], v) for k, v in trainer.state_dict().items())
    assert receiver.version == 1
    sync.shutdown()
    del first_sender
