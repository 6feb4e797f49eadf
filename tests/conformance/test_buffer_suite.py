"""The buffer suite's own mechanics (buffer 1.3): what correct designs pass, how it reports."""

from __future__ import annotations

import re
import time
from functools import partial

import torch
from tensordict import TensorDictBase

from posttrain.conformance import Status
from posttrain.conformance.runner import Session, run
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import RingBuffer
from tests.mutants import buffers

RING_WITHOUT_REPLACEMENT = Implementation(
    "buffer",
    partial(RingBuffer, sampling="without_replacement"),
    name="posttrain.RingBuffer(sampling='without_replacement')",
    capabilities={"checkpoint", "thread_safe", "read"},
    options={"sampling": "without_replacement"},
)


def test_reference_without_replacement_passes_every_applicable_requirement() -> None:
    # Until buffer 1.3 an empty extend restarted the epoch under way (BUF-015).
    rep = run(RING_WITHOUT_REPLACEMENT)
    assert rep.ok
    assert [
        r.message for r in rep.results if r.status not in (Status.PASS, Status.NOT_APPLICABLE)
    ] == []


def test_a_correct_priority_design_passes() -> None:
    rep = run(buffers.PRIORITIZED_RING)
    rows = {r.id: r for r in rep.results}
    assert rows["BUF-017"].status is Status.PASS
    assert [
        r.message for r in rep.results if r.status not in (Status.PASS, Status.NOT_APPLICABLE)
    ] == []


def test_an_accepted_bad_batch_fails_even_when_the_kits_own_sample_then_raises() -> None:
    impl = dict((i.name, i) for _, i in buffers.EXTRA_MUTANTS)["mutant-BUF-009-UncheckedListBuffer"]
    row = {r.id: r for r in run(impl).results}["BUF-009"]
    assert row.status is Status.FAIL, row
    assert row.message.startswith(
        "BUF-009: extend with key ('masks', 'all_attention_mask') missing: was accepted; "
        "len went from 6 to 8; then sample raised RuntimeError"
    ), row.message


def test_failure_messages_list_at_most_ten_ids() -> None:
    rows = {r.id: r for r in run(dict(buffers.EXTRA_MUTANTS)["BUF-006"]).results}
    msg = rows["BUF-006"].message
    assert "... and 7 more]" in msg, msg
    longest = max(len(re.findall(r"-?\d+", m)) for m in re.findall(r"\[[-\d, ]+", msg))
    assert longest <= 10, msg


class _RacesOnTheCursorOnly(buffers.UnlockedEviction):
    """UnlockedEviction with the rows copied under the lock: no reader sees a torn item, so
    only the indices (two items given one) and what survives can show the race."""

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        n = int(data.batch_size[0])
        if self._schema is None or n == 0 or self._len < self.capacity or n > self.capacity:
            return RingBuffer.extend(self, data)
        leaves = self._schema.validated_leaves(data, "extend")
        cursor = self._cursor
        time.sleep(0.002)
        idx = (torch.arange(n, dtype=torch.int64) + cursor) % self.capacity
        with self._lock:
            for k, dst in self._dst_items:
                dst[idx] = leaves[k]
            self._cursor = (cursor + n) % self.capacity
        return idx


def test_thread_safety_finds_one_index_returned_for_two_stored_items() -> None:
    impl = Implementation(
        "buffer", _RacesOnTheCursorOnly, name="races-on-cursor", capabilities={"thread_safe"}
    )
    session = Session(impl)
    row = session.run_one(session.contract.requirement("BUF-019"))
    assert row.status is Status.FAIL
    assert "extends returned one index for two items that must both have been stored" in (
        row.message
    ), row.message
