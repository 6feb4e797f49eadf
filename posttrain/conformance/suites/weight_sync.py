"""The weight-sync suite: one check per WS requirement (specs/weight_sync-v1.md).

The receiver's model is a tiny real HF causal LM with a persistent buffer (and a non-persistent
one, which is not in the ``state_dict``); the sender publishes the ``state_dict`` of a twin built
with another seed, so every parameter and the buffer differ before a sync. Two more models
widen the domains: :func:`mixed_model` (every floating dtype, an int64 step counter and a bool
mask in one model) and :func:`wrapped_model` (names under DDP's and torch.compile's wrapper
prefixes, beside names that merely contain them). With capability ``cross_process`` the factory
ships the model to the receiving process, and every check reads the receiver's weights back
through ``receiver.state_dict()``.
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
from posttrain.conformance.suites._compare import bits_equal
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.testing import tiny_causal_lm

Weights = dict[str, torch.Tensor]


class _Remote:
    """The receiver's model as the checks see it when it lives in another process."""

    def __init__(self, receiver: Any) -> None:
        self.receiver = receiver

    def state_dict(self) -> Weights:
        fetch = getattr(self.receiver, "state_dict", None)
        if not callable(fetch):
            raise _fail(
                "capability cross_process declared, but the receiver has no state_dict() "
                "to read its weights back from the other process"
            )
        out: Weights = fetch()
        return out


BUFFER = "conformance_stats"  # persistent: in the state_dict, so it is synced like a weight
SCRATCH = "conformance_scratch"  # non-persistent: not in the state_dict, never sent


def sync_model(seed: int) -> Any:
    """The suite's model: a tiny HF causal LM with a persistent and a non-persistent buffer.

    The persistent buffer (float statistics, as BatchNorm's running mean) is part of the
    ``state_dict`` and must be synced as every parameter is; the non-persistent one is not in
    it, and a receiver must not ask for it.

    Example:
        >>> m = sync_model(0)
        >>> BUFFER in m.state_dict(), SCRATCH in m.state_dict()
        (True, False)
    """
    model = tiny_causal_lm(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    model.register_buffer(BUFFER, torch.randn(4, generator=gen), persistent=True)
    model.register_buffer(SCRATCH, torch.randn(4, generator=gen), persistent=False)
    return model


# The integer buffers a model may hold beside its floats (WS-001/WS-005's domain): a 0-d int64
# step counter (as BatchNorm's num_batches_tracked) holding a value past 2**53, which a round
# trip through float64 changes, and a bool mask.
STEPS, MASK = "conformance_steps", "conformance_mask"


def mixed_model(seed: int) -> Any:
    """The suite's model with every floating dtype in it and integer buffers beside them.

    float16 and bfloat16 (the same width) sit in same-shaped tensors, float64 in the head,
    float32 in the rest; a 0-d int64 step counter and a bool mask are persistent buffers.

    Example:
        >>> sd = mixed_model(0).state_dict()
        >>> sorted({str(t.dtype) for t in sd.values()})  # doctest: +NORMALIZE_WHITESPACE
        ['torch.bfloat16', 'torch.bool', 'torch.float16', 'torch.float32', 'torch.float64',
         'torch.int64']
        >>> sd[STEPS].shape, sd[STEPS].item() > 2**53
        (torch.Size([]), True)
    """
    model = sync_model(seed)
    layer = model.model.layers[0]
    model.model.embed_tokens.to(torch.bfloat16)
    layer.self_attn.q_proj.to(torch.float16)
    layer.self_attn.k_proj.to(torch.bfloat16)
    layer.self_attn.v_proj.to(torch.float16)
    layer.input_layernorm.to(torch.bfloat16)
    layer.post_attention_layernorm.to(torch.float16)
    layer.mlp.down_proj.to(torch.float64)
    model.lm_head.to(torch.float64)
    gen = torch.Generator().manual_seed(seed + 7)
    model.register_buffer(STEPS, torch.tensor(2**62 + 2 * seed + 1, dtype=torch.int64))
    model.register_buffer(MASK, torch.rand(16, generator=gen) < 0.5)
    return model


# Wrapper prefixes a trainer's names carry (WS-001/WS-006's domain): DDP's and FSDP's
# ``module.``, torch.compile's ``_orig_mod.``, and the two nested either way.
WRAPPERS = ("module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.")


def wrapped_model(seed: int) -> Any:
    """The suite's model under wrapper prefixes, beside names that merely contain them.

    Its names: ``module._orig_mod.<the suite's model>`` (DDP around torch.compile),
    ``_orig_mod.module.weight`` (the other nesting), ``submodule.weight`` and
    ``not_orig_mod.weight`` (the substrings mid-name) and a plain ``head.weight``.

    Example:
        >>> [n for n in wrapped_model(0).state_dict() if not n.startswith("module.")]
        ['_orig_mod.module.weight', 'submodule.weight', 'not_orig_mod.weight', 'head.weight']
    """
    root, ddp, compiled = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    ddp.add_module("_orig_mod", sync_model(seed))
    root.add_module("module", ddp)
    compiled.add_module("module", torch.nn.Linear(4, 4, bias=False))
    root.add_module("_orig_mod", compiled)
    root.add_module("submodule", torch.nn.Linear(4, 2, bias=False))
    root.add_module("not_orig_mod", torch.nn.Linear(2, 2, bias=False))
    root.add_module("head", torch.nn.Linear(2, 3, bias=False))
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name in ("_orig_mod", "submodule", "not_orig_mod", "head"):
            for p in getattr(root, name).parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    return root


MODELS: dict[str, Callable[[int], Any]] = {
    "float32": sync_model,
    "mixed": mixed_model,
    "wrapped": wrapped_model,
}
"""The receiver models the suite syncs, by kind (see each builder)."""


def _setup(ctx: Context, kind: str = "float32") -> tuple[Any, Any, Any, Weights]:
    build = MODELS[kind]
    receiver_model = build(ctx.seed)
    source = {n: t.detach().clone() for n, t in build(ctx.seed + 1).state_dict().items()}
    pair = ctx.make(receiver_model)
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise _fail(
            f"the factory returned {type(pair).__name__}, expected a (sender, receiver) tuple"
        )
    model: Any = _Remote(pair[1]) if "cross_process" in ctx.capabilities else receiver_model
    return pair[0], pair[1], model, source


def _fresh_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """New values of ``t``'s dtype and shape: floats moved by noise, integers over their whole
    range, bools at random."""
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) < 0.5
    if t.is_floating_point():
        return t + torch.randn(t.shape, generator=gen).to(t.dtype)
    info = torch.iinfo(t.dtype)
    return torch.randint(info.min, info.max, t.shape, generator=gen, dtype=t.dtype)


def _bump_(t: torch.Tensor, delta: float) -> None:
    """Change every element of ``t`` in place, as a training step does (bools flip)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point():
        t.add_(delta)
    else:
        t.add_(1)


def _stepped(weights: Weights, delta: float) -> Weights:
    """A copy of ``weights`` with every element changed (see :func:`_bump_`)."""
    out = {n: t.detach().clone() for n, t in weights.items()}
    with torch.no_grad():
        for t in out.values():
            _bump_(t, delta)
    return out


def _sync(sender: Any, receiver: Any, weights: Weights, version: int) -> None:
    """A sync the spec allows: an exception from it is the implementation failing to sync."""
    try:
        sender.send(weights, version=version)
        receiver.receive(timeout=10.0)
    except Exception as e:
        raise _fail(
            f"send(w, version={version}) of {len(weights)} tensors, the receiver's state_dict "
            f"names, shapes and dtypes, then receive(): raised {type(e).__name__}: "
            f"{str(e)[:300]}; expected the weights applied"
        ) from e


def _diff(model: Any, weights: Weights) -> list[str]:
    own = model.state_dict()
    return [
        n
        for n, t in weights.items()
        if n not in own or not bits_equal(own[n].detach().cpu(), t.detach().cpu())
    ]


def _expect_equal(model: Any, weights: Weights, what: str) -> None:
    bad = _diff(model, weights)
    if bad:
        raise _fail(
            f"{what}: {len(bad)} of {len(weights)} tensors differ from what was sent, e.g. {bad[:3]}"
        )


# The forms a sent state dict takes (WS-001's domain): the tensors' own layout, as views at
# an offset into one flat buffer (a flattened parameter store), or non-contiguous (a transpose).
LAYOUTS = ("contiguous", "offset_views", "non_contiguous")
# Values whose bits a cast, a reduction or a sum of partial copies would change.
SPECIALS = (float("nan"), -float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0e38)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _specials(weights: Weights) -> Weights:
    """``weights`` with the special values written over the first elements of each tensor."""
    out = {}
    for n, t in weights.items():
        t = t.detach().clone()
        if not t.is_floating_point():
            out[n] = t
            continue
        flat = t.view(-1)
        k = min(len(SPECIALS), flat.numel())
        flat[:k] = torch.tensor(SPECIALS[:k], dtype=torch.float64).to(t.dtype)
        out[n] = t
    return out


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}


def _zeros_and_nans(weights: Weights, seed: int) -> Weights:
    """``weights`` with about half of each tensor's elements +0.0 or -0.0, and NaNs in every
    other tensor: the tensors without NaN compare equal (``==``, ``torch.equal``) to their
    :func:`_equal_twin`, the others equal with ``equal_nan``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (n, t) in enumerate(weights.items()):
        t = t.detach().clone()
        at = torch.rand(t.shape, generator=gen) < 0.5
        sign = -1.0 if seed % 2 else 1.0  # -0.0 then +0.0, or +0.0 then -0.0
        t[at] = torch.tensor(sign * 0.0, dtype=t.dtype)
        if i % 2:
            t[torch.rand(t.shape, generator=gen) < 0.2] = float("nan")
        out[n] = t
    return out


def _equal_twin(weights: Weights) -> Weights:
    """The same values with other bits: every zero and NaN has its sign flipped, and every NaN
    its lowest payload bit. A receiver that skips a tensor comparing equal to what it holds
    (a delta sync) keeps the old bits."""
    out = {}
    for n, t in weights.items():
        ints = _BITS.get(t.dtype, torch.int16 if t.element_size() == 2 else None)
        if ints is None or not t.is_floating_point():
            out[n] = t.detach().clone()
            continue
        bits = t.detach().clone().view(ints)
        nan, zero = torch.isnan(t), t == 0
        bits[nan | zero] ^= torch.iinfo(ints).min  # the sign bit
        bits[nan] ^= 1  # the payload's lowest bit (a quiet NaN stays a NaN)
        out[n] = bits.view(t.dtype)
    return out


def _laid_out(weights: Weights, layout: str) -> Weights:
    """The same values, stored as ``layout`` says (see LAYOUTS)."""
    if layout == "contiguous":
        return {n: t.detach().clone() for n, t in weights.items()}
    if layout == "offset_views":  # one flat buffer per dtype
        flats: dict[torch.dtype, torch.Tensor] = {}
        at: dict[torch.dtype, int] = {}
        for t in weights.values():
            at[t.dtype] = at.get(t.dtype, 3) + t.numel()
        for dtype, total in at.items():
            flats[dtype], at[dtype] = torch.zeros(total, dtype=dtype), 3
        out = {}  # every view starts past its storage's first element
        for n, t in weights.items():
            start = at[t.dtype]
            out[n] = flats[t.dtype][start : start + t.numel()].view(t.shape)
            out[n].copy_(t)
            at[t.dtype] = start + t.numel()
        return out
    out = {}
    for n, t in weights.items():
        if t.ndim >= 2:
            strided = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(
                *reversed(range(t.ndim))
            )
        else:
            strided = torch.empty(t.numel() * 2, dtype=t.dtype)[::2].view(t.shape)
        strided.copy_(t)
        out[n] = strided
    return out


def _ordered(weights: Weights, order: list[int]) -> Weights:
    names = list(weights)
    return {names[i]: weights[names[i]] for i in order}


def _same_shape_swaps(weights: Weights) -> list[int]:
    """An order that swaps neighbouring tensors of the same shape (and keeps the others)."""
    names = list(weights)
    order = list(range(len(names)))
    by: dict[tuple[Any, ...], list[int]] = {}
    for i, n in enumerate(names):
        by.setdefault((tuple(weights[n].shape), weights[n].dtype), []).append(i)
    for idx in by.values():
        for a, b in zip(idx[::2], idx[1::2], strict=False):
            order[a], order[b] = order[b], order[a]
    return order


@requirement("WS-001")
def bit_exact_after_sync(ctx: Context) -> None:
    from hypothesis import strategies as st

    sender, receiver, model, source = _setup(ctx)
    if not _diff(model, source):
        raise _fail("suite error: sender and receiver start equal")
    _sync(sender, receiver, source, 1)
    _expect_equal(model, source, "after send(version=1) and receive()")

    # The domain: any order of the names, any storage layout, every bit pattern; then other
    # dtypes of the receiver's model. One pair for all of it, each sync a new version.
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
    remote = "cross_process" in ctx.capabilities
    if remote and ctx.depth == 1:
        return  # a new receiving process per model: tried from depth 2
    # Every dtype in one model beside integer buffers, and names under wrapper prefixes: each
    # synced once, its names in a random order, as views at an offset, special values first.
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


def _kinds(weights: Weights) -> str:
    """The dtypes of ``weights``, in words."""
    return ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}))


def _variant(weights: Weights, k: int) -> Weights:
    """``weights`` with ``k`` added to every floating tensor: each version sends its own."""
    return {n: t + k if t.is_floating_point() else t.clone() for n, t in weights.items()}


def _held(model: Any, sent: dict[int, Weights]) -> str:
    """Which of ``sent``'s versions the model's weights are, in words."""
    for v, w in sent.items():
        if not _diff(model, w):
            return f"the weights of version {v}"
    return "weights of none of them"


def _mix(model: Any, sent: dict[int, Weights], versions: tuple[int, ...]) -> str:
    """How many of the model's tensors are each of ``versions``' weights, in words."""
    own = {n: t.detach().cpu() for n, t in model.state_dict().items()}
    by: dict[str, list[str]] = {}
    for n in sent[versions[0]]:
        got = own.get(n)
        match = [v for v in versions if got is not None and bits_equal(got, sent[v][n].cpu())]
        by.setdefault(f"version {match[-1]}'s" if match else "no send's", []).append(n)
    return ", ".join(f"{len(ns)} {k} (e.g. {ns[:2]})" for k, ns in sorted(by.items()))


def _snapshot(w: Weights) -> Weights:
    return {n: t.detach().clone() for n, t in w.items()}


class _SyncSpec:
    """The executable model of WS-002 (and of WS-003's in-place changes), driven on one pair.

    ``held`` is the version the receiver must report and ``unadopted`` the sends not yet
    adopted. A send leaves ``held`` alone; a ``receive()`` with sends pending adopts the next
    or the newest of them (either is allowed) and drops the older ones; one with nothing
    pending changes nothing. After every step the model holds ``held``'s weights (or, under
    ``applies_on_send``, one unadopted send's, whole). Sends are fresh dicts or the
    ``state_dict()`` of a live trainer module changed in place between sends (the same tensor
    objects, new values), also while a send of it is pending; right after a send returns the
    trainer may step (:meth:`step`), changing in place every tensor not yet adopted: what a
    receive() adopts is the weights as they were at their send. With ``aliasing`` (WS-003)
    the sender's tensors of every adopted send may be changed in place, and the receiver's
    model must not move. ``kind`` names the receiver's model (:data:`MODELS`).
    """

    def __init__(self, ctx: Context, *, aliasing: bool = False, kind: str = "float32") -> None:
        self.sender, self.receiver, self.model, self.source = _setup(ctx, kind)
        self.applies_on_send = "applies_on_send" in ctx.capabilities
        self.aliasing = aliasing
        self.trainer = MODELS[kind](ctx.seed + 2)
        self.held = int(self.receiver.version)
        self.sent: dict[int, Weights] = {self.held: _snapshot(self.model.state_dict())}
        self.objects: dict[int, Weights] = {}  # what was passed to send, by version
        self.live: set[int] = set()  # versions sent as the trainer's live state_dict
        self.unadopted: list[int] = []

    def weights(self, live: bool, seed: int) -> tuple[Weights, bool]:
        """The next send's weights: the trainer's live tensors stepped in place, or fresh."""
        gen = torch.Generator().manual_seed(seed)
        if live:
            with torch.no_grad():
                for t in self.trainer.state_dict().values():
                    t.copy_(_fresh_like(t, gen))
            return self.trainer.state_dict(), True
        return {n: _fresh_like(t, gen) for n, t in self.source.items()}, False

    def send(
        self, weights: Weights, version: int, *, live: bool = False, step: float | None = None
    ) -> None:
        """Send ``weights`` as ``version``; with ``step``, the trainer steps right after."""
        self.sent[version] = _snapshot(weights)
        self.objects[version] = weights
        if live:
            self.live.add(version)
        self.sender.send(weights, version=version)
        self.unadopted.append(version)
        what = f"after send(version={version})"
        if step is not None:
            self.step(step)
            what += f" and a training step changing the sent tensors in place (by {step:g})"
        self.check(f"{what}, before a receive()")

    def step(self, delta: float) -> None:
        """The trainer steps in place: its live tensors and every tensor of a send not yet
        adopted change (a trainer reusing its buffers); the weights as sent stay the spec's."""
        tensors = [*self.trainer.state_dict().values()]
        tensors += [t for v in self.unadopted for t in self.objects[v].values()]
        seen: set[tuple[int, torch.dtype]] = set()
        with torch.no_grad():
            for t in tensors:
                if (t.data_ptr(), t.dtype) not in seen:  # a state_dict's tensors are new views
                    seen.add((t.data_ptr(), t.dtype))
                    _bump_(t, delta)

    def receive(self) -> None:
        if not self.unadopted:
            with contextlib.suppress(TimeoutError, FuturesTimeout):
                self.receiver.receive(timeout=0.01)
            self.check("after a receive() with nothing sent since the last one")
            return
        pending = list(self.unadopted)
        self.receiver.receive(timeout=10.0)
        got = self.receiver.version
        allowed = sorted({pending[0], pending[-1]})
        if got not in allowed:
            raise _fail(
                f"after a receive() with versions {pending} sent since the last, "
                f"receiver.version is {got!r}; expected "
                + " or ".join(map(str, allowed))
                + " (the next pending send or the newest)"
            )
        self.held = int(got)
        self.unadopted = [v for v in pending if v > got]
        self.check(f"after a receive() with versions {pending} sent since the last")
        if self.aliasing:  # the trainer's next step changes what it sent, right after a sync
            self.change(1.0)

    def check(self, what: str) -> None:
        got = self.receiver.version
        if got != self.held:
            raise _fail(
                f"{what}: receiver.version is {got!r}; expected {self.held} (the version "
                f"adopted last; sends not yet adopted: {self.unadopted})"
            )
        if self.aliasing:
            return
        if not self.applies_on_send or not self.unadopted:
            if _diff(self.model, self.sent[self.held]):
                pending = f"; sends not yet adopted: {self.unadopted}" if self.unadopted else ""
                raise _fail(
                    f"{what}: receiver.version is {self.held} but the model holds "
                    f"{_held(self.model, self.sent)}{pending}{self._moved()}"
                )
            return
        whole = (self.held, *self.unadopted)
        if all(_diff(self.model, self.sent[v]) for v in whole):
            raise _fail(
                f"{what}, under capability applies_on_send, the model's tensors are "
                f"{_mix(self.model, self.sent, whole)}; expected the weights of version "
                + " or ".join(map(str, whole))
                + ", whole"
            )

    def _moved(self) -> str:
        """Whether the model holds a send's tensors as they are now, changed since the send."""
        now = [
            v
            for v, w in self.objects.items()
            if any(not bits_equal(t, self.sent[v][n]) for n, t in w.items())
            and not _diff(self.model, w)
        ]
        if not now:
            return ""
        return (
            f"; it holds the values the tensors sent as version {now[-1]} have now, changed in "
            "place after that send returned: expected the weights as they were at the send"
        )

    def change(self, delta: float) -> None:
        """The sender changes in place every tensor it sent under a version adopted or dropped."""
        before = _snapshot(self.model.state_dict())
        done = [v for v in self.objects if v <= self.held]
        if self.live & set(self.unadopted):
            done = [v for v in done if v not in self.live]
        with torch.no_grad():
            for v in done:
                for t in self.objects[v].values():
                    _bump_(t, delta)
        changed = _diff(self.model, before)
        if changed:
            raise _fail(
                f"after the sender changed in place the tensors it sent as versions {done} "
                f"(adopted or dropped: version {self.held} is held), the receiver's model "
                f"changed: {len(changed)} tensors, e.g. {changed[:3]}"
            )
        for v in done:
            self.objects.pop(v)


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


# Version gaps the machine draws: the next version, skips, and a jump past 2**31 (a version
# kept in an int32 wraps there); and the versions it starts above, so that its sequences
# cross digit counts (9 to 10, 99 to 100) and 2**31.
GAPS = (1, 1, 2, 9, 2**31)
STARTS = (0, 7, 97, 2**31 - 3)


def _examples(ctx: Context, n: int) -> int:
    """Sequences per machine: each builds a pair, a new process under ``cross_process``."""
    return 2 if "cross_process" in ctx.capabilities and ctx.depth == 1 else n


def _machine(ctx: Context, *, aliasing: bool = False) -> type[Any]:
    """Random send/receive sequences, each on a new pair, against :class:`_SyncSpec`."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    steps = st.sampled_from((None, 1.0, -0.5, 1e6)) if not aliasing else st.just(None)

    class WeightSyncMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.last = 0

        @initialize(start=st.sampled_from(STARTS), model=st.sampled_from(tuple(MODELS)))
        def start_above(self, start: int, model: str) -> None:
            self.spec = _SyncSpec(ctx, aliasing=aliasing, kind=model)
            self.last = start

        @rule(gap=st.sampled_from(GAPS), live=st.booleans(), seed=st.integers(0, 2**16), step=steps)
        def send(self, gap: int, live: bool, seed: int, step: float | None) -> None:
            self._send(gap, live, seed, step)

        @rule(gap=st.sampled_from(GAPS), live=st.booleans(), seed=st.integers(0, 2**16), step=steps)
        def sync(self, gap: int, live: bool, seed: int, step: float | None) -> None:
            """A send and the receive() right after it: a trainer's usual step."""
            self._send(gap, live, seed, step)
            self.receive()

        def _send(self, gap: int, live: bool, seed: int, step: float | None) -> None:
            weights, live = self.spec.weights(live, seed)
            self.last += gap
            self.spec.send(weights, self.last, live=live, step=step)

        @rule()
        def receive(self) -> None:
            self.spec.receive()

        @precondition(lambda self: not aliasing)
        @rule(delta=st.sampled_from((1.0, -0.5, 1e6)))
        def train(self, delta: float) -> None:
            """The trainer steps with sends pending or not, then the model is compared."""
            self.spec.step(delta)
            self.spec.check(f"after a training step (by {delta:g}) changed the sent tensors")

        @precondition(lambda self: aliasing)
        @rule(delta=st.sampled_from((1.0, -0.5, 1e6)))
        def change_sent_tensors(self, delta: float) -> None:
            self.spec.change(delta)

    WeightSyncMachine.__name__ = "WeightSyncMachine"
    return WeightSyncMachine


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
