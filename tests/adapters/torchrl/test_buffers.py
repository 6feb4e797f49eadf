"""TorchRL's real buffers through the suite: the raw deviations are found, the adapter conforms."""

from __future__ import annotations

import runpy

import pytest
import torch
from tensordict import TensorDict

import posttrain.adapters.torchrl.implementations as trl_impls
from posttrain.adapters.torchrl import ValidatedReplayBuffer
from posttrain.adapters.torchrl.deviations import DEVIATIONS, Deviation
from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.contracts import ContractViolation
from tests.outcomes import own_failures

# What TorchRL 0.14.1 really does is declared on each raw row (known_failures); a change
# upstream changes what fails and this test says so.
RAW = ["RAW_LAZY_TENSOR", "RAW_LAZY_TENSOR_NO_REPLACEMENT", "RAW_LAZY_MEMMAP", "RAW_LAZY_STACK"]


@pytest.mark.parametrize("name", RAW)
def test_raw_torchrl_deviations_are_found(name: str) -> None:
    impl = getattr(trl_impls, name)
    failing = own_failures(impl)
    assert set(failing) == impl.known_failures, failing
    assert {"BUF-009", "BUF-010", "BUF-011", "BUF-012"} <= set(failing)


def test_raw_messages_are_precise() -> None:
    messages = own_failures(trl_impls.RAW_LAZY_TENSOR)
    assert messages["BUF-009"].startswith(
        "BUF-009: extend with key ('masks', 'all_attention_mask') missing: was accepted; len went from 6 to 8"
    )
    assert "raised RuntimeError without naming 'log_probs' and 'full'" in messages["BUF-011"]
    assert (
        "the next extend wrote at [1, 2, 3, 4]; an untouched buffer writes at [6, 7, 0, 1]"
        in messages["BUF-012"]
    )


@pytest.mark.parametrize(
    "name",
    # The cross-process rows run in tests/adapters/ray/ (which own the Ray cluster's lifetime)
    # and tests/adapters/torchrl/test_dist_weight_sync.py.
    [
        n
        for n in sorted(vars(trl_impls))
        if n.startswith("ADAPTED_") and "_RAY_" not in n and "_DIST_" not in n
    ],
)
def test_adapted_torchrl_conforms(name: str) -> None:
    assert own_failures(getattr(trl_impls, name)) == {}


def test_priority_is_reported_unavailable_with_its_reason() -> None:
    rep = run(trl_impls.ADAPTED_LAZY_TENSOR)
    row = {r.id: r for r in rep.results}["BUF-017"]
    assert row.status is Status.NOT_APPLICABLE
    assert "C++ extension" in row.message
    reason = trl_impls.prioritized_unavailable()
    assert reason is None or "C++ extension" in reason


def test_adapter_adds_no_copy() -> None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    inner = TensorDictReplayBuffer(storage=LazyTensorStorage(4))
    rb = ValidatedReplayBuffer(inner)
    td = TensorDict({"x": torch.arange(3.0)}, batch_size=[3])
    rb.extend(td)
    with pytest.raises(
        ContractViolation, match="BUF-011 key 'x': expected dtype float32, found dtype float64"
    ):
        rb.extend(TensorDict({"x": torch.arange(3.0, dtype=torch.float64)}, batch_size=[3]))
    assert len(inner) == 3
    assert inner.write_count == 3


@pytest.mark.parametrize("copy", [True, False])
def test_list_storage_copies_unless_told_the_batches_are_handed_over(copy: bool) -> None:
    from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

    rb = ValidatedReplayBuffer(
        TensorDictReplayBuffer(storage=LazyStackStorage(4)), ragged=True, copy=copy
    )
    td = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    rb.extend(td)
    td["x"].add_(1.0)  # the caller writes into its batch after handing it over
    rb.sample(2)["x"].add_(1.0)  # and into a sample
    stored = rb.read(torch.tensor([0, 1]))["x"]
    assert stored.eq(0.0).all().item() is copy
    assert stored.ge(1.0).all().item() is not copy


@pytest.mark.parametrize("deviation", DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_repro_still_reproduces(deviation: Deviation) -> None:
    runpy.run_path(str(deviation.path), run_name="__main__")  # as `python <repro>` runs it


def test_every_raw_failure_has_a_published_repro() -> None:
    found = set().union(*(getattr(trl_impls, n).known_failures for n in RAW))
    assert found == {r for d in DEVIATIONS if not d.blocked_by for r in d.requirements}
    # A deviation a full run reports as blocked is blocked by a declared failure.
    assert {b for d in DEVIATIONS for b in d.blocked_by} <= found


def test_adapter_refuses_a_state_without_its_schema_before_touching_the_storage() -> None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    def make() -> ValidatedReplayBuffer:
        return ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(8)))

    src = make()
    src.extend(TensorDict({"x": torch.ones(3)}, batch_size=[3]))
    rb = make()
    rb.extend(TensorDict({"z": torch.arange(3)}, batch_size=[3]))
    with pytest.raises(ValueError, match=r"expected keys \['rb', 'schema'\].*found \['rb'\]"):
        rb.load_state_dict({"rb": src.state_dict()["rb"]})
    bad_schema = {"rb": src.state_dict()["rb"], "schema": [(("x",), "no_such_dtype", [])]}
    with pytest.raises(ValueError, match=r"state_dict\['schema'\]: expected ItemSchema"):
        rb.load_state_dict(bad_schema)
    back = rb.read(torch.arange(3))
    assert back["z"].tolist() == [0, 1, 2]
    assert "x" not in back
    with pytest.raises(ContractViolation):
        rb.extend(TensorDict({"x": torch.ones(1)}, batch_size=[1]))  # the schema is still z's


def test_adapter_checks_sample_size_and_read_indices() -> None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(8)))
    rb.extend(TensorDict({"z": torch.arange(3)}, batch_size=[3]))
    for bad in (-1, 2.5, None, True):
        with pytest.raises(ValueError, match=f"batch_size: expected an int >= 0, found {bad!r}"):
            rb.sample(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected integer indices, found dtype float32"):
        rb.read(torch.tensor([0.5]))
    assert len(rb) == 3


def test_adapter_samples_numpy_sizes_as_torchrl_does() -> None:
    import numpy as np
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(8)))
    rb.extend(TensorDict({"z": torch.arange(3)}, batch_size=[3]))
    assert rb.sample(np.int64(2)).batch_size == torch.Size([2])  # type: ignore[arg-type]
