"""The weight-sync suite: one check per WS requirement (specs/weight_sync-v1.md).

The receiver's model is a tiny real HF causal LM with a persistent buffer (and a non-persistent
one, which is not in the ``state_dict``); the sender publishes the ``state_dict`` of a twin built
with another seed, so every parameter and the buffer differ before a sync. Two more models
widen the domains: ``mixed_model`` (every floating dtype, an int64 step counter and a bool
mask in one model) and ``wrapped_model`` (names under DDP's and torch.compile's wrapper
prefixes, beside names that merely contain them). With capability ``cross_process`` the factory
ships the model to the receiving process, and every check reads the receiver's weights back
through ``receiver.state_dict()``.

What the checks share lives beside them: the models and the forms of a sent mapping
(``_weight_sync_domains``), a pair built, synced and read back (``_weight_sync_pair``), and the
executable model of WS-002/WS-003 with the random sequences driven against it
(``_weight_sync_model``).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before 3.11
from typing import Any

import torch

from posttrain.conformance import explore
from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._weight_sync_domains import (
    DTYPES,
    LAYOUTS,
    MASK,
    STEPS,
    WRAPPERS,
    Weights,
    sync_model,
)
from posttrain.conformance.suites._weight_sync_domains import equal_twin as _equal_twin
from posttrain.conformance.suites._weight_sync_domains import fresh_like as _fresh_like
from posttrain.conformance.suites._weight_sync_domains import kinds as _kinds
from posttrain.conformance.suites._weight_sync_domains import laid_out as _laid_out
from posttrain.conformance.suites._weight_sync_domains import ordered as _ordered
from posttrain.conformance.suites._weight_sync_domains import same_shape_swaps as _same_shape_swaps
from posttrain.conformance.suites._weight_sync_domains import specials as _specials
from posttrain.conformance.suites._weight_sync_domains import stepped as _stepped
from posttrain.conformance.suites._weight_sync_domains import variant as _variant
from posttrain.conformance.suites._weight_sync_domains import zeros_and_nans as _zeros_and_nans
from posttrain.conformance.suites._weight_sync_model import SyncSpec as _SyncSpec
from posttrain.conformance.suites._weight_sync_model import examples as _examples
from posttrain.conformance.suites._weight_sync_model import machine as _machine
from posttrain.conformance.suites._weight_sync_pair import Remote as _Remote
from posttrain.conformance.suites._weight_sync_pair import diff as _diff
from posttrain.conformance.suites._weight_sync_pair import expect_equal as _expect_equal
from posttrain.conformance.suites._weight_sync_pair import setup as _setup
from posttrain.conformance.suites._weight_sync_pair import sync as _sync


@requirement("WS-001")
def bit_exact_after_sync(ctx: Context) -> None:
    sender, receiver, model, source = _setup(ctx)
    if not _diff(model, source):
        raise _fail("suite error: sender and receiver start equal")
    _sync(sender, receiver, source, 1)
    _expect_equal(model, source, "after send(version=1) and receive()")
    _orders_layouts_bits(ctx, sender, receiver, model, source)
    if "cross_process" in ctx.capabilities and ctx.depth == 1:
        return  # a new receiving process per model: tried from depth 2
    _other_models(ctx)
    _other_dtypes(ctx)


def _orders_layouts_bits(
    ctx: Context, sender: Any, receiver: Any, model: Any, source: Weights
) -> None:
    """WS-001's domain on one pair, each sync a new version: one pair for all of it keeps a
    receiving process per example out of a cross-process run."""
    from hypothesis import strategies as st

    # The domain: any order of the names, any storage layout, every bit pattern.
    n = len(source)
    version = [1]

    def one(case: tuple[list[int], str, bool, int, bool]) -> None:
        order, layout, special, noise, twin = case
        gen = torch.Generator().manual_seed(noise)
        values = {k: t + torch.randn(t.shape, generator=gen).to(t.dtype) for k, t in source.items()}
        if special:
            values = _specials(values)
        what = (
            f"the names in order {order} (the receiver's own is {list(range(n))}), tensors "
            f"{layout}" + (", special values (NaN, -0.0, inf, subnormal) first" if special else "")
        )
        if twin:  # values equal to the ones the receiver holds, in other bits
            values = _zeros_and_nans(values, noise)
            version[0] += 1
            _sync(sender, receiver, _ordered(_laid_out(values, layout), order), version[0])
            _expect_equal(model, values, f"after syncing version {version[0]} with {what}")
            values = _equal_twin(values)
            what += (
                ", the values of the sync before with every zero's and NaN's sign flipped "
                "(equal under ==, other bits)"
            )
        version[0] += 1
        _sync(sender, receiver, _ordered(_laid_out(values, layout), order), version[0])
        _expect_equal(model, values, f"after syncing version {version[0]} with {what}")

    ident = list(range(n))
    explore.for_all(
        ctx,
        st.tuples(
            st.permutations(ident),
            st.sampled_from(LAYOUTS),
            st.booleans(),
            st.integers(0, 2**16),
            st.booleans(),
        ),
        one,
        examples=6,
        boundaries=[
            (ident[::-1], "contiguous", False, 1, False),
            (_same_shape_swaps(source), "offset_views", True, 2, False),
            (ident, "non_contiguous", True, 3, False),
            (ident, "contiguous", False, 4, True),
            (ident[::-1], "offset_views", False, 5, True),
        ],
    )


def _other_models(ctx: Context) -> None:
    """Every dtype in one model beside integer buffers, and names under wrapper prefixes: each
    synced once, its names in a random order, as views at an offset, special values first."""
    order = random.Random(ctx.seed)
    for kind in ("mixed", "wrapped"):
        sender, receiver, model, source = _setup(ctx, kind)
        gen = torch.Generator().manual_seed(ctx.seed)
        sent = _specials({n: _fresh_like(t, gen) for n, t in source.items()})
        names = list(sent)
        order.shuffle(names)
        _sync(sender, receiver, _laid_out({n: sent[n] for n in names}, "offset_views"), 1)
        _expect_equal(
            model,
            sent,
            f"after syncing the {kind} model ({_kinds(sent)}) with its names in the order "
            f"{names[:4]}..., tensors as views at an offset, special values first",
        )


def _other_dtypes(ctx: Context) -> None:
    """The suite's model cast whole to each other floating dtype (one at depth 1: a cast model
    is a new pair)."""
    remote = "cross_process" in ctx.capabilities
    for dtype in DTYPES[1 : 2 if ctx.depth == 1 else None]:
        receiver_model = sync_model(ctx.seed).to(dtype)
        sender, receiver = ctx.make(receiver_model)
        sent = _specials(
            {k: t.detach().to(dtype) for k, t in sync_model(ctx.seed + 1).state_dict().items()}
        )
        _sync(sender, receiver, _laid_out(sent, "offset_views"), 1)
        _expect_equal(
            _Remote(receiver) if remote else receiver_model,
            sent,
            f"a {dtype} model after a sync of {dtype} weights (views at an offset, special values)",
        )


# Several sends pending at one receive(): across a digit count (a version compared as text
# takes 9 for newer than 10) and around 2**31 (a version kept in an int32 wraps there).
PENDING_GROUPS = ((6, 7), (8, 9, 10), (98, 99, 100, 101), (2**31 - 1, 2**31, 2**31 + 1))


@requirement("WS-002")
def version_propagates(ctx: Context) -> None:
    # Distinct weights per version: a receiver reporting one version while holding another's
    # weights is caught only if the two differ.
    spec = _SyncSpec(ctx)
    versions = [1, 2, 5, *(v for group in PENDING_GROUPS for v in group)]
    weights = {v: _variant(spec.source, k + 1) for k, v in enumerate(versions)}
    # The trainer steps in place right after each send returns (a receiver that stages a
    # reference to the sent tensors, not a copy, then applies the step's values).
    for v in (1, 2, 5):
        spec.send(weights[v], v, step=1000.0)
        spec.receive()
    # Queue semantics adopt the next at each receive; latest-wins adopts the newest at once.
    for group in PENDING_GROUPS:
        for v in group:
            spec.send(weights[v], v, step=-3.0)
        while spec.unadopted:
            spec.receive()
    explore.run_machine(ctx, _machine(ctx), examples=_examples(ctx, 5), steps=12)


@requirement("WS-003")
def no_aliasing(ctx: Context) -> None:
    sender, receiver, model, source = _setup(ctx)
    _sync(sender, receiver, source, 1)
    snapshot = {n: t.clone() for n, t in source.items()}
    with torch.no_grad():
        for t in source.values():
            t.add_(1)
    _expect_equal(model, snapshot, "after the sender changed its tensors in place following a sync")
    # A second sync of a fresh mapping, changed in place once received: a receiver that copies
    # only the first sync and keeps later ones by reference moves with it.
    second = {n: t + 2 for n, t in snapshot.items()}
    _sync(sender, receiver, second, 2)
    kept = {n: t.clone() for n, t in second.items()}
    with torch.no_grad():
        for t in second.values():
            t.add_(1)
    _expect_equal(
        model, kept, "after a second sync and the sender's in-place change of what it sent"
    )
    explore.run_machine(ctx, _machine(ctx, aliasing=True), examples=_examples(ctx, 4), steps=10)


class _Rejections:
    """One pair synced once; each bad send must raise naming the tensor and change nothing.

    The pair is reused across the domain (a rejected send leaves the receiver as it was, so
    the next one starts from the same state); each bad send carries a new, higher version.
    ``kind`` names the receiver's model (:data:`MODELS`).
    """

    def __init__(self, ctx: Context, kind: str) -> None:
        self.sender, self.receiver, self.model, self.source = _setup(ctx, kind)
        _sync(self.sender, self.receiver, self.source, 1)
        self.version = 1

    def names(self) -> list[str]:
        return list(self.source)

    def bad(self, change: Callable[[Weights], Weights], what: str, names: tuple[str, ...]) -> None:
        before = {n: t.clone() for n, t in self.model.state_dict().items()}
        # The version the receiver itself reports, not the one sent: a receiver whose version
        # is wrong after a good sync breaks WS-002, not this requirement.
        version_before = self.receiver.version
        bad = change(_stepped(self.source, 0.5))
        self.version += 1
        problems: list[str] = []
        try:
            self.sender.send(bad, version=self.version)
            self.receiver.receive(timeout=1.0)
        except Exception as e:
            if not any(_names(n, str(e)) for n in names):
                named = " or ".join(map(repr, names))
                problems.append(f"raised {type(e).__name__} without naming {named}: {str(e)[:200]}")
        else:
            problems.append("was accepted")
        try:
            changed = _diff(self.model, before)
            version = self.receiver.version
        except Exception as e:  # a receiver in another process may not have survived the send
            problems.append(
                f"the receiver could no longer be read back ({type(e).__name__}: {str(e)[:200]})"
            )
        else:
            if changed:
                problems.append(
                    f"the receiver's model changed ({len(changed)} tensors, e.g. {changed[:3]})"
                )
            if version != version_before:
                problems.append(f"receiver.version went from {version_before!r} to {version!r}")
        if problems:
            raise _fail(
                f"weights with {what} (send(version={self.version})): " + "; ".join(problems)
            )


def _names(name: str, text: str) -> bool:
    """Whether ``text`` names ``name`` whole: not as a part of a longer dotted name
    (``head.weight`` is not named by ``lm_head.weight`` or ``module.head.weight``)."""
    return re.search(r"(?<![\w.])" + re.escape(name) + r"(?![\w]|\.\w)", text) is not None


def _last(weights: Weights) -> str:
    return list(weights)[-1]


# Wrong shapes (WS-004's domain): element count changed, and the same element count in
# another shape (a receiver comparing sizes, or copying through reshape, takes those).
SHAPE_FAULTS = ("one row longer", "one row shorter", "flattened", "reshaped", "unsqueezed")


def _misshaped(t: torch.Tensor, fault: str) -> torch.Tensor:
    if t.ndim == 0:  # a 0-d step counter: flattened or unsqueezed it keeps its one element
        one = t.reshape(1)
        if fault == "one row longer":
            return one.repeat(2)
        if fault == "one row shorter":
            return one[:0].clone()
        return (one.reshape(1, 1) if fault == "reshaped" else one).clone()
    if fault == "one row longer":
        return torch.cat([t, t[:1]])
    if fault == "one row shorter" and t.shape[0] > 1:
        return t[1:].clone()
    if fault == "flattened" and t.ndim != 1:
        return t.reshape(-1).clone()
    if fault == "reshaped":
        if t.ndim >= 2 and t.shape[0] != t.shape[1]:
            return t.transpose(0, 1).contiguous()
        if t.ndim >= 2:
            return t.reshape(t.shape[0] * 2, t.shape[1] // 2, *t.shape[2:]).clone()
        return t.reshape(2, -1).clone()
    return t.unsqueeze(0).clone()


@requirement("WS-004")
def shape_mismatch_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    r = _Rejections(ctx, "mixed")
    names = r.names()

    def one(case: tuple[int, str]) -> None:
        i, fault = case
        n = names[i]

        def change(w: Weights) -> Weights:
            return {**w, n: _misshaped(w[n], fault)}

        shape = list(_misshaped(r.source[n], fault).shape)
        r.bad(change, f"{n!r} {fault} ({list(r.source[n].shape)} sent as {shape})", (n,))

    last = len(names) - 1
    square = next(
        i
        for i, n in enumerate(names)
        if r.source[n].ndim == 2 and r.source[n].shape[0] == r.source[n].shape[1]
    )
    explore.for_all(
        ctx,
        st.tuples(st.integers(0, last), st.sampled_from(SHAPE_FAULTS)),
        one,
        examples=8,
        boundaries=[
            (last, "one row longer"),
            (last, "reshaped"),
            (square, "reshaped"),
            (names.index(STEPS), "flattened"),
            (names.index(MASK), "one row longer"),
            (0, "flattened"),
            (len(names) // 2, "unsqueezed"),
        ],
    )


# Wrong dtypes (WS-005's domain), sent for a tensor of any dtype of the mixed model: wider,
# narrower, floats and integers of the tensor's own width (a receiver comparing element sizes
# takes float16 for bfloat16, int32 for float32, int64 for float64, uint8 for bool).
WRONG_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
SAME_WIDTH = {
    torch.float16: torch.bfloat16,
    torch.bfloat16: torch.float16,
    torch.float32: torch.int32,
    torch.int32: torch.float32,
    torch.float64: torch.int64,
    torch.int64: torch.float64,
    torch.bool: torch.uint8,
    torch.uint8: torch.bool,
}


@requirement("WS-005")
def dtype_mismatch_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    r = _Rejections(ctx, "mixed")
    names = r.names()

    def one(case: tuple[int, torch.dtype]) -> None:
        i, dtype = case
        n = names[i]
        own = r.source[n].dtype
        if dtype == own:
            dtype = SAME_WIDTH[own]
        r.bad(lambda w: {**w, n: w[n].to(dtype)}, f"{n!r} ({own}) as {dtype}", (n,))

    # Each dtype's first tensor sent as the other dtype of its width, then the old boundaries.
    first = {r.source[n].dtype: i for i, n in reversed(list(enumerate(names)))}
    explore.for_all(
        ctx,
        st.tuples(st.integers(0, len(names) - 1), st.sampled_from(WRONG_DTYPES)),
        one,
        examples=6,
        boundaries=[
            *((first[d], SAME_WIDTH[d]) for d in SAME_WIDTH if d in first),
            (len(names) - 1, torch.float32),
            (names.index(STEPS), torch.int32),
        ],
    )


# Wrong names (WS-006's domain), on the model under wrapper prefixes: one missing, one unknown
# added (a made-up name, or a wrapper prefix on a name the model has, sent beside it), one
# renamed (a suffix, a wrapper prefix added, or the first "module." or "_orig_mod." in it
# taken out, as a trainer with or without DDP or torch.compile would send it), at every
# position, the mapping's names in a random order.
NAME_FAULTS = ("missing", "unknown", "renamed", "prefixed", "stripped", "wrapped twin")
UNKNOWN = "model.extra_head.weight"


def _stripped(name: str) -> str:
    """``name`` without the first wrapper prefix in it, wherever it sits (``module.`` or
    ``_orig_mod.``, as a careless ``str.replace`` takes it out)."""
    at = [(name.find(w), w) for w in ("module.", "_orig_mod.") if w in name]
    if not at:
        return name
    i, w = min(at)
    return name[:i] + name[i + len(w) :]


@requirement("WS-006")
def names_checked(ctx: Context) -> None:
    from hypothesis import strategies as st

    r = _Rejections(ctx, "wrapped")
    names = r.names()

    def one(case: tuple[int, str, int, int]) -> None:
        i, fault, w, order = case
        n, wrapper = names[i], WRAPPERS[w]
        change: Callable[[Weights], Weights]
        named: tuple[str, ...]
        if fault == "missing":
            what, named = f"{n!r} missing", (n,)
            change = lambda w: {k: t for k, t in w.items() if k != n}  # noqa: E731
        elif fault in ("unknown", "wrapped twin"):
            new = UNKNOWN if fault == "unknown" else wrapper + n
            what, named = f"an unknown name {new!r}", (new,)
            change = lambda w: {**w, new: torch.zeros(2) if new == UNKNOWN else w[n]}  # noqa: E731
        else:
            new = {"renamed": n + "_renamed", "prefixed": wrapper + n}.get(fault, _stripped(n))
            if new == n or new in r.source:
                new = wrapper + n
            what, named = f"{n!r} renamed {new!r} (as many names as the model's)", (n, new)
            change = lambda w: {(new if k == n else k): t for k, t in w.items()}  # noqa: E731

        def shuffled(w: Weights) -> Weights:
            out = change(w)
            keys = list(out)
            random.Random(order).shuffle(keys)
            return {k: out[k] for k in keys}

        r.bad(shuffled, f"{what}, the names in a random order", named)

    def at(name: str) -> int:
        return names.index(name)

    last = len(names) - 1
    hf = [i for i, n in enumerate(names) if n.startswith("module._orig_mod.")]
    explore.for_all(
        ctx,
        st.tuples(
            st.integers(0, last),
            st.sampled_from(NAME_FAULTS),
            st.integers(0, len(WRAPPERS) - 1),
            st.integers(0, 2**16),
        ),
        one,
        examples=6,
        boundaries=[
            (hf[-1], "stripped", 0, 1),
            (at("head.weight"), "prefixed", 0, 2),
            (at("head.weight"), "wrapped twin", 1, 3),
            (hf[0], "prefixed", 2, 4),
            (at("_orig_mod.module.weight"), "stripped", 0, 5),
            (at("submodule.weight"), "stripped", 0, 6),
            (at("not_orig_mod.weight"), "stripped", 0, 7),
            (last, "missing", 0, 8),
            (0, "unknown", 0, 9),
            (last // 2, "renamed", 3, 10),
        ],
    )


SLACK_S = 1e-3
"""How far ``last_sync_s`` may exceed the kit's own timing of a sync, and the sum of them
the sum of the kit's timings (clocks read in another order, or another clock)."""


def _latency(s: object, window: float, what: str) -> float:
    """``last_sync_s`` checked against the kit's wall time of the sync it reports."""
    if not isinstance(s, (int, float)) or not s >= 0:
        raise _fail(f"receiver.last_sync_s is {s!r} {what}; expected seconds (a number >= 0)")
    # The sync happened inside the send and receive the kit timed: seconds, not milliseconds.
    if s > window + SLACK_S:
        raise _fail(
            f"receiver.last_sync_s is {s:g} {what}, whose sends and receive took {window:.6f} s "
            "in all: not the last sync's wall time in seconds"
        )
    return float(s)


class _LatencySpec:
    """WS-007's model: after every receive() that adopts a version, ``last_sync_s`` is at most
    the kit's wall time from the earliest send it could adopt to that receive's return, and
    the values read, summed over the pair's syncs, at most the sum of those wall times: a
    value covering more than its own sync (a running total, time since the first sync) fails
    there after a few syncs."""

    def __init__(self, ctx: Context) -> None:
        self.sender, self.receiver, _model, self.source = _setup(ctx)
        self.version = self.held = 0
        self.pending: dict[int, float] = {}  # version -> when its send began
        self.reported = self.timed = 0.0
        self.syncs = 0

    def send(self) -> None:
        self.version += 1
        start = time.perf_counter()
        self.sender.send(_variant(self.source, self.version), version=self.version)
        self.pending[self.version] = start

    def receive(self) -> None:
        if not self.pending:
            with contextlib.suppress(TimeoutError, FuturesTimeout):
                self.receiver.receive(timeout=0.01)
            return
        self.receiver.receive(timeout=10.0)
        end = time.perf_counter()
        got = self.receiver.version
        window = end - min(self.pending.values())
        self.pending = {v: t for v, t in self.pending.items() if v > got}
        if got == self.held:
            return  # nothing adopted (WS-002's concern): no sync to read the time of
        self.held = got
        self.syncs += 1
        s = _latency(
            getattr(self.receiver, "last_sync_s", None),
            window,
            f"after sync {self.syncs} of this pair (version {got})",
        )
        self.reported += s
        self.timed += window
        if self.reported > self.timed + SLACK_S:
            raise _fail(
                f"receiver.last_sync_s, read after each of the {self.syncs} syncs of this pair, "
                f"sums to {self.reported:.6f} s, while those syncs took {self.timed:.6f} s in "
                "all by the kit's clock: it reports more than its last sync's wall time (a "
                f"running total?); last read {s:g} s after a sync of {window:.6f} s"
            )


def _latency_machine(ctx: Context) -> type[Any]:
    """Runs of 1 to 6 syncs in a row, sends left pending and receives, each sequence on a
    new pair, against :class:`_LatencySpec`."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    class LatencyMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.spec = _LatencySpec(ctx)

        @rule(count=st.integers(1, 6))
        def syncs(self, count: int) -> None:
            """``count`` syncs in a row, each a send and the receive() right after it."""
            for _ in range(count):
                self.spec.send()
                self.spec.receive()

        @rule()
        def send(self) -> None:
            self.spec.send()

        @rule()
        def receive(self) -> None:
            self.spec.receive()

    LatencyMachine.__name__ = "LatencyMachine"
    return LatencyMachine


@requirement("WS-007")
def latency_reported(ctx: Context) -> None:
    # Twelve syncs in a row, three sends then receives until none is pending, four syncs more:
    # last_sync_s read after every receive that adopts a version.
    spec = _LatencySpec(ctx)
    for sends in (*([1] * 12), 3, *([1] * 4)):
        for _ in range(sends):
            spec.send()
        for _ in range(sends):  # queue semantics adopt one send per receive
            if spec.pending:
                spec.receive()
    if "cross_process" in ctx.capabilities and ctx.depth == 1:
        return  # a new receiving process per sequence: tried from depth 2
    explore.run_machine(ctx, _latency_machine(ctx), examples=2, steps=6)


@requirement("WS-008")
def cross_process(ctx: Context) -> None:
    sender, receiver, _model, source = _setup(ctx)
    pid = getattr(receiver, "pid", None)
    if not isinstance(pid, int) or pid == os.getpid():
        raise _fail(
            f"capability cross_process declared, but receiver.pid is {pid!r} (this process is {os.getpid()})"
        )
    _sync(sender, receiver, source, 1)
    if receiver.version != 1:
        raise _fail(
            f"across processes, receiver.version is {receiver.version!r} after syncing version 1"
        )
    _expect_equal(_Remote(receiver), source, "across processes, after a sync")


@requirement("WS-009")
def cuda_receiver(ctx: Context) -> None:
    if not torch.cuda.is_available():
        raise NotApplicable("capability 'cuda' declared, but this machine has no CUDA device")
    receiver_model = sync_model(ctx.seed).cuda()
    source = {n: t.detach().clone() for n, t in sync_model(ctx.seed + 1).state_dict().items()}
    sender, receiver = ctx.make(receiver_model)
    _sync(sender, receiver, source, 1)
    model: Any = _Remote(receiver) if "cross_process" in ctx.capabilities else receiver_model
    _expect_equal(model, source, "CUDA receiver after a sync of CPU weights")
