"""Contract ``buffer`` v1: a replay buffer of TensorDict items (TorchRL's signatures)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from posttrain._args import non_negative_int
from posttrain.contracts.contract import Capability, Contract, Option
from posttrain.contracts.requirements import Level, Requirement


class ReplayBufferV1(Protocol):
    """A replay buffer: TorchRL's ``ReplayBuffer`` surface, reduced to what every loop uses.

    Items are the rows of a TensorDict with batch dims ``[N]``. Parameters are positional so
    TorchRL's buffers (whose argument names differ between classes) conform natively.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> rb: ReplayBufferV1 = RingBuffer(capacity=4)
        >>> rb.extend(TensorDict({"x": torch.arange(3)}, batch_size=[3])).tolist()
        [0, 1, 2]
        >>> len(rb), rb.sample(5).batch_size
        (3, torch.Size([5]))
    """

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Write every item of ``data``; return the storage indices written, in order."""
        ...

    def sample(self, batch_size: int, /) -> Any:
        """Return ``batch_size`` stored items as a TensorDict with batch size ``[batch_size]``."""
        ...

    def __len__(self) -> int:
        """Number of items stored (never more than the capacity)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Contents and write position, enough to resume bit-exactly."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


@runtime_checkable
class SupportsPriority(Protocol):
    """Capability ``priority``: per-item sampling priorities (TorchRL's signature).

    Example:
        >>> class P:
        ...     def update_priority(self, index, priority): ...
        >>> isinstance(P(), SupportsPriority)
        True
    """

    def update_priority(self, index: Any, priority: Any, /) -> None:
        """Set the priority of the items at ``index``."""
        ...


@runtime_checkable
class SupportsCheckpoint(Protocol):
    """Capability ``checkpoint``: save to and load from a directory (TorchRL's signature).

    Example:
        >>> class C:
        ...     def dumps(self, path): ...
        ...     def loads(self, path): ...
        >>> isinstance(C(), SupportsCheckpoint)
        True
    """

    def dumps(self, path: Any, /) -> Any:
        """Write the buffer's state under ``path``."""
        ...

    def loads(self, path: Any, /) -> Any:
        """Restore the state :meth:`dumps` wrote under ``path``."""
        ...


@runtime_checkable
class SupportsRead(Protocol):
    """Capability ``read`` (v1.1): the items at storage indices, as ``extend`` returned them.

    TorchRL's buffers index their storage (``rb[index]``); this is that, with range checks.

    Example:
        >>> class R:
        ...     def read(self, indices): ...
        >>> isinstance(R(), SupportsRead)
        True
    """

    def read(self, indices: torch.Tensor, /) -> Any:
        """A TensorDict [len(indices)] of the items stored at ``indices``, in that order."""
        ...


def sample_size(batch_size: Any) -> int:
    """``batch_size`` for a ``sample`` as an int >= 0 (numpy and 0-d integer tensors too).

    Example:
        >>> import numpy as np
        >>> sample_size(np.int64(4))
        4
        >>> sample_size(2.5)
        Traceback (most recent call last):
        ...
        ValueError: batch_size: expected an int >= 0, found 2.5
    """
    return non_negative_int("batch_size", batch_size)


def storage_indices(indices: Any, length: int) -> torch.Tensor:
    """``indices`` for a ``read`` of a buffer holding ``length`` items, as 1-D int64.

    Raises ``TypeError`` for float or bool indices (truncating 0.5 to 0 would read an item
    nobody asked for) and ``IndexError`` naming every index that holds no item.

    Example:
        >>> storage_indices([2, 0], length=3).tolist()
        [2, 0]
        >>> storage_indices(torch.tensor([0.5]), length=3)
        Traceback (most recent call last):
        ...
        TypeError: read: expected integer indices, found dtype float32
    """
    idx = torch.as_tensor(indices)
    if idx.numel() == 0:  # [] has no dtype of its own (torch makes it float32)
        return torch.empty(0, dtype=torch.int64)
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"read: expected integer indices, found dtype {str(idx.dtype)[6:]}")
    idx = idx.to(torch.int64).reshape(-1)
    bad = idx[(idx < 0) | (idx >= length)]
    if bad.numel():
        raise IndexError(
            f"read: indices {bad.tolist()} hold no item (stored: "
            + (f"0..{length - 1})" if length else "none)")
        )
    return idx


_M, _S = Level.MUST, Level.SHOULD

BUFFER = Contract(
    id="buffer",
    version="1.6",
    title="Replay buffer",
    purpose=(
        "Stores rollout items (rows of a TensorDict, usually in the LLM layout) and samples them "
        "for training. The first item written fixes the stored schema (keys, dtypes, trailing "
        "shapes); every later write must match it exactly. The indices `extend` returns address "
        "the items it wrote, for `update_priority` (capability `priority`) and `read` (capability "
        "`read`). Out of scope in v1: leaves that are not tensors (strings, non-tensor data: a "
        "buffer may refuse them), and the sampling order under way as part of a saved state (after "
        "`load_state_dict` or `loads`, sampling without replacement may start a new epoch), and "
        "`sample(0)` (a buffer may return an empty batch or raise). Keys: a key is a tuple of "
        "non-empty names, nested to any depth; a name may hold any character but '/' and NUL "
        "('.', '_', '-', spaces and non-ASCII letters included), and two keys are the same only "
        "when their tuples are equal: `('a', 'b')`, `'a.b'` and `'a_b'` are three keys, and a "
        "buffer keeps each apart in what it stores, samples, reads and saves (BUF-001, BUF-006, "
        "BUF-018, BUF-022). Two exceptions in v1: through `state_dict` (BUF-014) names holding "
        "'.' are out of scope, as state dicts join nested names with '.' (`nn.Module.state_dict`, "
        "`TensorDict.state_dict`); and names holding '/' or NUL, or empty ones, are out of scope "
        "(a buffer may refuse them, naming the key)."
    ),
    protocol=ReplayBufferV1,
    extra_protocols=(SupportsPriority, SupportsCheckpoint, SupportsRead),
    factory="factory(capacity: int) -> ReplayBufferV1  # a fresh, empty buffer",
    uses_layout=True,
    capabilities=(
        Capability(name="priority", text="`update_priority(index, priority)` changes how often items are drawn.", methods=("update_priority",), undeclared="Sampling is uniform over the stored items (BUF-007 reaches every item; BUF-016 visits each once per epoch); `update_priority` is not called."),
        Capability(name="checkpoint", text="`dumps(path)` / `loads(path)` save and restore the buffer on disk.", methods=("dumps", "loads"), undeclared="No `dumps`/`loads` is called; `state_dict` round trips (BUF-014) still are."),
        Capability(name="thread_safe", text="`extend` and `sample` may be called from several threads at once.", undeclared="Every call is made from one thread: concurrent use is not checked (and not promised)."),
        Capability(name="ragged", text="Items may differ in their 'T' dimension (lazy stacks / jagged tensors).", undeclared="Every item of a buffer has the first write's T: an item whose T differs is a wrong trailing shape (BUF-012)."),
        Capability(name="cuda", text="Storage lives on a CUDA device; samples come back on it.", undeclared="Samples come back on the CPU, bit-exactly (BUF-006)."),
        Capability(name="read", text="`read(indices)` returns the items at storage indices (as `extend` returned them); since 1.1.", methods=("read",), undeclared="No `read` is called; the indices `extend` returns are still checked (BUF-001)."),
        Capability(name="remote_writers", text="`client()` returns a picklable handle to the same buffer that Ray tasks in the cluster the buffer lives in extend concurrently; since 1.2.", methods=("client",), undeclared="Every extend comes from the buffer's own process."),
    ),
    options=(
        Option(name="eviction", values=("fifo",), default="fifo", text="Which stored item a write replaces when the buffer is full."),
        Option(name="sampling", values=("with_replacement", "without_replacement"), default="with_replacement", text="How `sample` draws items."),
    ),
    requirements=(
        Requirement(id="BUF-001", level=_M, title="extend returns indices", tightened=("1.3", "1.5", "1.6"),
            text="`extend(data)` with batch dims [N] MUST store the N items and return a 1-D integer tensor of the N storage indices written, in order.",
            domain="random sequences of extends of 1 to 12 items (1, 2 and 9 always) into capacities 1, 2, 3, 5 and 8, T from 4 to 12, values ordinary, of every bit pattern of each dtype or its boundary values alone, contiguous or column-major, interleaved with samples; and the fill-wrap-replace-wrap sequence 3, 4, 3, 5, 8, 2 into capacity 8. Keys inserted in a shuffled order. Each sequence's items hold the layout's keys alone or beside one of these key sets: `'a.b'` with `('a', 'b')`; `'next.reward'`, `'tokens.full'` and `('next', 'ref_log_probs.full')` (the layout's own keys joined with '.'); `('x', 'y', 'z')`, `'x.y.z'`, `('x.y', 'z')` and `('x', 'y.z')`; `'a_b'`, `('a', 'b')`, `'clé'`, `'键'`, `('ключ', 'значение')`, `'with space'` and `'dash-name'` (int64 [N] and float32 [N, 3] leaves, distinct per key)."),
        Requirement(id="BUF-002", level=_M, title="len counts items", tightened=("1.5",),
            text="`len(buffer)` MUST equal the number of items stored and MUST never exceed the capacity.", depends_on=("BUF-001",),
            domain="the sequences of BUF-001; len read after every extend and restore."),
        Requirement(id="BUF-003", level=_M, title="FIFO eviction", tightened=("1.5",), option=("eviction", "fifo"),
            text="When full, `extend` MUST overwrite the oldest stored items first.", depends_on=("BUF-001",),
            domain="the sequences of BUF-001, contents sampled at the end of each; one extend longer than the capacity."),
        Requirement(id="BUF-004", level=_M, title="sample batch size",
            text="`sample(n)` MUST return a TensorDict with batch size [n].", depends_on=("BUF-001",),
            domain="sample(n) for n in 1..len, and within the sequences of BUF-001 sample(k) for k from 1 to 16 (at most len without replacement)."),
        Requirement(id="BUF-005", level=_M, title="sample schema",
            text="A sample MUST carry every key of the stored schema, with the stored dtype and trailing shape (bookkeeping keys such as TorchRL's `index` may be added).", depends_on=("BUF-004",),
            domain="a sample of 3 from 4 items of the LLM layout (every field)."),
        Requirement(id="BUF-006", level=_M, title="sample holds stored items", tightened=("1.3", "1.5", "1.6"),
            text="Every sampled item MUST be bit-exactly an item that was written, as it was when `extend` was called (the caller may reuse its tensors afterwards), and is still stored.", depends_on=("BUF-004",),
            domain="the sequences of BUF-001 (their key sets included) with every sample checked bit-exactly (NaN payloads, -0.0, subnormals and integer extremes included), and the caller overwriting the batch it last extended at any point. Sampling need not reach every stored item here (BUF-007, BUF-016 ask that)."),
        Requirement(id="BUF-007", level=_M, title="sampling with replacement", tightened=("1.5",), option=("sampling", "with_replacement"),
            text="With replacement, `sample(n)` MUST accept n > len(buffer), and repeated sampling MUST reach every stored item.", depends_on=("BUF-006",),
            domain="the sequences of BUF-001 with samples of up to 16 items whatever len is (1 item stored included)."),
        Requirement(id="BUF-008", level=_M, title="sample is a copy", tightened=("1.3",),
            text="Mutating a sample in place MUST NOT change what the buffer stores.", depends_on=("BUF-006",),
            domain="every tensor of a sample of 4 overwritten in place."),
        Requirement(id="BUF-009", level=_M, title="missing key rejected atomically", tightened=("1.3",),
            text="`extend` with a key of the stored schema missing MUST raise an error naming the key and MUST leave contents, len, indices and future writes unchanged.", depends_on=("BUF-001",),
            domain="every stored key missing in turn."),
        Requirement(id="BUF-010", level=_M, title="extra key rejected atomically",
            text="`extend` with a key outside the stored schema MUST raise an error naming the key and MUST leave the buffer unchanged.", depends_on=("BUF-001",),
            domain="one extra nested key."),
        Requirement(id="BUF-011", level=_M, title="wrong dtype rejected atomically", tightened=("1.3", "1.5"),
            text="`extend` with a wrong dtype MUST raise an error naming the key (no silent cast) and MUST leave the buffer unchanged.", depends_on=("BUF-001",),
            domain="every stored key given as each other real dtype (bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64), in batches of 1 to 10 items, into buffers holding 1 to 16 writes (full and wrapped included); always log-probs as float64, tokens as int32, log-probs as bfloat16."),
        Requirement(id="BUF-012", level=_M, title="wrong shape rejected atomically", tightened=("1.3", "1.5"),
            text="`extend` with a wrong trailing shape MUST raise an error naming the key and MUST leave the buffer unchanged.", depends_on=("BUF-001",),
            domain="every stored key with its last dim one longer or one shorter, its elements regrouped with the count kept ([N, T] as [N, T/2, 2] or [N, 1, T]; [N] as [N, 1]) or a trailing dim of 1 added, in batches of 1 to 10 into buffers holding 1 to 16 writes; a buffer declaring `ragged` gets T changes on the tokens only."),
        Requirement(id="BUF-013", level=_M, title="empty sample raises", tightened=("1.3",),
            text="`sample` on an empty buffer MUST raise a clear error rather than return garbage: one whose message says the buffer is empty (words such as 'empty', 'no items' or 'len 0').",
            domain="sample(2) on a buffer never written to."),
        Requirement(id="BUF-014", level=_M, title="state round trip", tightened=("1.3", "1.5", "1.6"),
            text="`load_state_dict(state_dict())` into a fresh buffer MUST reproduce contents and write position bit-exactly as they were when `state_dict()` was called (later writes to the original change neither), so the next `extend` writes where the original would have; the state MUST survive `torch.save` and `torch.load(weights_only=True)` (tensors and plain data: a checkpoint that loads without running code).", depends_on=("BUF-001",),
            domain="the sequences of BUF-001 with `state_dict()` restored (through torch.save) into a fresh buffer that carries on, at any point, empty included, their key sets less those with a name holding '.'; and a snapshot, of items with the keys `'a_b'`, `('a', 'b')`, `'clé'`, `'键'`, `('ключ', 'значение')`, `'with space'` and `'dash-name'` beside the layout's, restored after the original moved on."),
        Requirement(id="BUF-015", level=_S, title="empty extend", tightened=("1.3", "1.5"),
            text="`extend` of a batch with N = 0 SHOULD be a no-op (contents, write position and the sampling order under way unchanged) that returns an empty index tensor.", depends_on=("BUF-001",),
            domain="extends of 0 items into a buffer of 6, five times between the samples of an epoch without replacement; and an extend of 0 items, of another T, into a fresh buffer, before its first items."),
        Requirement(id="BUF-016", level=_M, title="epochs without replacement", option=("sampling", "without_replacement"), tightened=("1.4",),
            text="Without replacement, consecutive samples MUST visit every stored item exactly once before any repeats.", depends_on=("BUF-006",),
            domain="five epochs of 6 items, and extends between the samples of an epoch."),
        Requirement(id="BUF-017", level=_M, title="priorities steer sampling", capability="priority", tightened=("1.3",),
            text="After `update_priority` on the indices `extend` returned, an item with zero priority MUST NOT be drawn while items with positive priority remain, and higher priority MUST be drawn more often.", depends_on=("BUF-006",),
            domain="priorities 10, 1 and 0 set by the indices two extends returned after a wrap, in a scrambled order; 2000 draws."),
        Requirement(id="BUF-018", level=_M, title="dumps/loads round trip", capability="checkpoint", tightened=("1.3", "1.5", "1.6"),
            text="`loads(path)` into a fresh buffer after `dumps(path)` MUST reproduce contents and write position bit-exactly.", depends_on=("BUF-001",),
            domain="the sequences of BUF-001 (their key sets included) with `dumps`/`loads` into a fresh buffer that carries on, at any point, empty included; and a checkpoint of items holding every key of those sets at once beside the layout's, loaded before and after the original moved on. A `loads` that raises on what `dumps` wrote fails."),
        Requirement(id="BUF-019", level=_M, title="thread safety", capability="thread_safe", tightened=("1.3",),
            text="Under 4 writer and 4 reader threads, with and without eviction, no written item MUST be lost or duplicated, the indices the extends return MUST differ between items stored at the same time, and every sample MUST hold only written items.", depends_on=("BUF-006",),
            domain="4 writers x 10 extends of 2 and 4 readers, into capacities 80 (no eviction) and 32."),
        Requirement(id="BUF-020", level=_M, title="ragged items", capability="ragged",
            text="Items whose 'T' differs, within a batch and between batches, MUST be stored and sampled back bit-exactly, with their own lengths.", depends_on=("BUF-001",),
            domain="two extends of 4 items of T 4 to 10, each item its own T."),
        Requirement(id="BUF-021", level=_M, title="CUDA storage", capability="cuda",
            text="With CUDA storage, samples MUST come back on the storage device, bit-exactly.", depends_on=("BUF-006",),
            domain="4 items sampled back from CUDA storage."),
        Requirement(id="BUF-022", level=_M, title="read by index", tightened=("1.5", "1.6"), capability="read", since="1.1",
            text="`read(indices)` MUST return, in the order asked, bit-exactly the item the latest write put at each index, and MUST raise an error naming the index for one that holds no item.", depends_on=("BUF-001",),
            domain="the sequences of BUF-001 (their key sets included) with reads of 1 to 10 stored indices in random orders, repeats included; an index holding no item. Bad indices: an unwritten slot, -1, -capacity, capacity and capacity + 3."),
        Requirement(id="BUF-023", level=_M, title="many producers, one learner", capability="remote_writers", since="1.2",
            text="Once a first write has fixed the schema, items extended concurrently through `client()` handles by 3 Ray tasks while this process samples MUST each be stored exactly once: `len` MUST equal the number written, the indices the extends returned MUST be distinct and cover exactly the positions written, every sample MUST hold only written items bit-exactly, and an extend with a missing key sent by a producer MUST raise there, naming the key, and leave the buffer unchanged.", depends_on=("BUF-006",),
            domain="3 Ray tasks extending concurrently while this process samples; one extend with a key missing."),
        Requirement(id="BUF-024", level=_S, title="loads runs no code", capability="checkpoint", since="1.4",
            text="`loads(path)` of a directory `dumps` wrote, with any one of its files replaced by a pickle that runs code when unpickled (a checksum manifest rewritten to match), SHOULD raise, run none of that code and leave the buffer unchanged (a MUST from v2).", depends_on=("BUF-018",),
            domain="every file `dumps` wrote, in turn replaced by a torch.save or bare pickle that runs code."),
        Requirement(id="BUF-025", level=_S, title="consistent snapshots", capability="thread_safe", since="1.5",
            text="While other threads extend, `state_dict()` (and with `checkpoint` `dumps`, with `read` `read`) SHOULD capture whole items: restored, every item bit-exactly one written item, never fields of two different writes (a MUST from v2).", depends_on=("BUF-014", "BUF-018"),
            domain="4 writers extending a full buffer of 16 by 2 (40 distinct batches each, then around them again) while this thread takes 12 rounds (times --conformance-depth) of `state_dict()`, and with `checkpoint` `dumps`, with `read` `read(all indices)`; the writers stop only once the rounds are taken, so every snapshot overlaps writes."),
    ),
)  # fmt: skip
