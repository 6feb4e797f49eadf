"""The reference buffer's own behaviour beyond the suite: errors, layout, edge cases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from posttrain.contracts import ContractViolation
from posttrain.reference_impls import RingBuffer
from posttrain.testing import item_uids, llm_batch


def test_rejected_extend_names_every_key_and_changes_nothing() -> None:
    rb = RingBuffer(8, seed=0)
    rb.extend(llm_batch(5))
    state = rb.state_dict()
    bad = llm_batch(2, uid_start=5).exclude(("next", "reward"))
    bad.set(("log_probs", "full"), bad.get(("log_probs", "full")).half())
    bad.set("extra", torch.zeros(2))
    with pytest.raises(ContractViolation) as info:
        rb.extend(bad)
    msg = str(info.value)
    assert msg.startswith("RingBuffer.extend (buffer unchanged): 3 contract violation(s)")
    assert (
        "BUF-009 key ('next', 'reward'): expected float32 [] (stored schema), found no such key"
        in msg
    )
    assert "BUF-011 key ('log_probs', 'full'): expected dtype float32, found dtype float16" in msg
    assert "BUF-010 key 'extra'" in msg
    after = rb.state_dict()
    assert torch.equal(after["rows"], state["rows"])
    assert (after["cursor"], after["len"], after["write_count"]) == (
        state["cursor"],
        state["len"],
        state["write_count"],
    )


def test_batch_longer_than_capacity_keeps_the_tail() -> None:
    rb = RingBuffer(4, seed=0)
    rb.extend(llm_batch(2))
    idx = rb.extend(llm_batch(7, uid_start=2))
    assert idx.tolist() == [2, 3, 0, 1, 2, 3, 0]
    assert sorted(set(item_uids(rb.sample(200)))) == [5, 6, 7, 8]
    assert rb.write_count == 9


def test_without_replacement_epochs() -> None:
    rb = RingBuffer(6, sampling="without_replacement", seed=1)
    rb.extend(llm_batch(6))
    uids = item_uids(rb.sample(4)) + item_uids(rb.sample(2))
    assert sorted(uids) == list(range(6))
    with pytest.raises(ValueError, match="at most len"):
        rb.sample(7)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="capacity: expected a positive int, found 0"):
        RingBuffer(0)
    with pytest.raises(ValueError, match="sampling: expected"):
        RingBuffer(4, sampling="prioritized")
    rb = RingBuffer(4)
    with pytest.raises(RuntimeError, match="empty buffer"):
        rb.sample(1)
    with pytest.raises(ContractViolation, match="batch dims \\[N\\]"):
        rb.extend(TensorDict({"x": torch.zeros(2, 2)}, batch_size=[2, 2]))
    with pytest.raises(ValueError, match="capacity'\\]: expected 4, found 8"):
        rb.load_state_dict(RingBuffer(8).state_dict())


def test_mixed_dtypes_are_stored_bit_exactly(tmp_path: Path) -> None:
    td = TensorDict(
        {
            "b": torch.tensor([[True, False, True]] * 3),
            "h": torch.arange(3, dtype=torch.float16),
            "i32": torch.arange(6, dtype=torch.int32).view(3, 2),
            "d": torch.tensor([1.5, float("nan"), -0.0], dtype=torch.float64),
            ("n", "x"): torch.arange(3, dtype=torch.int64),
        },
        batch_size=[3],
    )
    rb = RingBuffer(3, sampling="without_replacement", seed=0)
    rb.extend(td)
    rb.dumps(tmp_path / "ckpt")
    fresh = RingBuffer(3, sampling="without_replacement", seed=0)
    fresh.loads(tmp_path / "ckpt")
    for buf in (rb, fresh):
        out = buf.sample(3)
        order = out.get(("n", "x")).argsort()
        out = out[order]
        for k in td.keys(True, True):
            a, b = out.get(k), td.get(k)
            assert a.dtype == b.dtype
            assert torch.equal(
                a.view(torch.uint8) if a.dtype != torch.bool else a,
                b.view(torch.uint8) if b.dtype != torch.bool else b,
            )
    assert "keys=[" in repr(rb)


def _same_state(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]  # type: ignore[arg-type]
        for k in a
    )


def _corrupt(state: dict[str, object], key: str) -> dict[str, object]:
    bad = dict(state)
    if key == "rows":
        bad["rows"] = state["rows"][:, :-8]  # type: ignore[index]
    elif key == "rng":
        bad["rng"] = torch.zeros(3, dtype=torch.uint8)
    elif key == "cursor":
        bad["cursor"] = 1  # the ring is not full: the cursor must be at len
    elif key == "schema":
        bad["schema"] = [(("x",), "not_a_dtype", ())]
    elif key == "epoch":
        bad["epoch"] = [99]
    else:
        del bad[key]
    return bad


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("rows", "state_dict['rows']: expected uint8 [3, "),
        ("rng", "state_dict['rng']: expected a CPU torch.Generator state"),
        ("cursor", "state_dict['cursor']: expected len (3)"),
        ("schema", "state_dict['schema']: expected ItemSchema.to_state()'s output"),
        ("epoch", "state_dict['epoch']: expected a list of ints in [0, 3)"),
        ("write_count", "missing ['write_count']"),
    ],
)
def test_a_bad_state_is_refused_whole_with_the_buffer_unchanged(key: str, says: str) -> None:
    other = RingBuffer(8, seed=1)
    other.extend(llm_batch(3, uid_start=100))
    rb = RingBuffer(8, seed=0)
    rb.extend(TensorDict({"z": torch.arange(5)}, batch_size=[5]))
    before = rb.state_dict()
    with pytest.raises(ValueError, match=re.escape(says)):
        rb.load_state_dict(_corrupt(other.state_dict(), key))
    assert _same_state(rb.state_dict(), before)
    assert rb.read(torch.arange(5))["z"].tolist() == [0, 1, 2, 3, 4]
    assert "keys=['z']" in repr(rb)


def test_read_refuses_float_and_bool_indices_and_capacity_refuses_bool() -> None:
    rb = RingBuffer(4, seed=0)
    rb.extend(llm_batch(2))
    with pytest.raises(TypeError, match="expected integer indices, found dtype float32"):
        rb.read(torch.tensor([0.5]))
    with pytest.raises(TypeError, match="found dtype bool"):
        rb.read(torch.tensor([True, False]))
    with pytest.raises(IndexError, match=r"indices \[2\] hold no item \(stored: 0..1\)"):
        rb.read(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="capacity: expected a positive int, found True"):
        RingBuffer(True)  # bool is an int subclass, not a size


def test_numpy_sizes_empty_reads_and_a_state_without_rows() -> None:
    import numpy as np

    rb = RingBuffer(4, seed=0)
    rb.extend(llm_batch(3))
    assert rb.sample(np.int64(2)).batch_size == torch.Size([2])  # type: ignore[arg-type]
    assert rb.read(torch.tensor([])).batch_size == torch.Size([0])
    state = rb.state_dict()
    with pytest.raises(ValueError, match=re.escape("state_dict['rows']: expected uint8 [3, ")):
        RingBuffer(4).load_state_dict({**state, "rows": None})
