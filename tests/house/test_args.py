"""One argument check for counts and sizes: any integral number, never a bool or a float."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from posttrain.adapters.trl import BufferDataset
from posttrain.reference_impls import RingBuffer, ThreadGenerationServer
from posttrain.testing import llm_batch, tiny_causal_lm


def test_numpy_integers_are_sizes_everywhere() -> None:
    rb = RingBuffer(np.int64(4))  # type: ignore[arg-type]
    assert rb.capacity == 4
    assert type(rb.capacity) is int
    rb.extend(llm_batch(4))
    assert rb.sample(np.int64(2)).batch_size == torch.Size([2])  # type: ignore[arg-type]
    ds = BufferDataset(rb, np.int64(2), num_batches=np.int32(1))  # type: ignore[arg-type]
    assert ds.batch_size == 2
    assert type(ds.batch_size) is int
    assert len(list(ds)) == 2


@pytest.mark.parametrize("bad", [True, 2.0, -1, 0, "2", None])
@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("capacity", lambda v: RingBuffer(v)),
        ("batch_size", lambda v: BufferDataset(RingBuffer(4), v)),
        ("num_batches", lambda v: BufferDataset(RingBuffer(4), 2, num_batches=v)),
        ("max_batch_size", lambda v: ThreadGenerationServer(tiny_causal_lm(), max_batch_size=v)),
    ],
)
def test_bools_floats_and_non_positive_values_are_refused_by_name(
    name: str, make: Any, bad: object
) -> None:
    if name == "num_batches" and bad is None:
        return  # None means unbounded there
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive int, found {bad!r}$"):
        make(bad)


@pytest.mark.parametrize("bad", [True, 2.0, -1])
def test_sample_refuses_bool_float_and_negative_batch_sizes(bad: object) -> None:
    rb = RingBuffer(4)
    rb.extend(llm_batch(2))
    with pytest.raises(ValueError, match=rf"^batch_size: expected an int >= 0, found {bad!r}$"):
        rb.sample(bad)  # type: ignore[arg-type]
