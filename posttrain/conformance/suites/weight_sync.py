"""The weight-sync suite: one check per WS requirement (specs/weight_sync-v1.md).

The receiver's model is a tiny real HF causal LM with a persistent buffer (and a non-persistent
one, which is not in the ``state_dict``); the sender publishes the ``state_dict`` of a twin built
with another seed, so every parameter and the buffer differ before a sync. With capability
``cross_process`` the factory ships that model to the receiving process, and every check reads
the receiver's weights back through ``receiver.state_dict()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

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


def _setup(ctx: Context) -> tuple[Any, Any, Any, Weights]:
    receiver_model = sync_model(ctx.seed)
    source = {n: t.detach().clone() for n, t in sync_model(ctx.seed + 1).state_dict().items()}
    pair = ctx.make(receiver_model)
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise _fail(
            f"the factory returned {type(pair).__name__}, expected a (sender, receiver) tuple"
        )
    model: Any = _Remote(pair[1]) if "cross_process" in ctx.capabilities else receiver_model
    return pair[0], pair[1], model, source


def _sync(sender: Any, receiver: Any, weights: Weights, version: int) -> None:
    sender.send(weights, version=version)
    receiver.receive(timeout=10.0)


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


@requirement("WS-001")
def bit_exact_after_sync(ctx: Context) -> None:
    sender, receiver, model, source = _setup(ctx)
    if not _diff(model, source):
        raise _fail("suite error: sender and receiver start equal")
    _sync(sender, receiver, source, 1)
    _expect_equal(model, source, "after send(version=1) and receive()")


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


@requirement("WS-002")
def version_propagates(ctx: Context) -> None:
    sender, receiver, model, source = _setup(ctx)
    applies_on_send = "applies_on_send" in ctx.capabilities
    # Distinct weights per version: a receiver reporting one version while holding another's
    # weights is caught only if the two differ.
    sent: dict[int, Weights] = {0: {n: t.detach().clone() for n, t in model.state_dict().items()}}
    for v in (1, 2, 5, 6, 7):
        sent[v] = _variant(source, v)
    unadopted: list[int] = []  # sent, not yet adopted by a receive()

    def between(what: str) -> None:
        # Read right after send returns: a transport that writes on send has written by then
        # (TorchRL's schemes return once the receiving end acknowledged).
        held = receiver.version
        if not applies_on_send:
            if _diff(model, sent[held]):
                raise _fail(
                    f"{what}, receiver.version is {held} but the model holds "
                    f"{_held(model, sent)}; expected version {held}'s weights unchanged until "
                    "a receive() adopts the new ones (a receiver whose send writes into the "
                    "model declares capability applies_on_send)"
                )
            return
        whole = (held, *unadopted)
        if all(_diff(model, sent[v]) for v in whole):
            want = " or ".join(map(str, whole))
            raise _fail(
                f"{what}, under capability applies_on_send, the model's tensors are "
                f"{_mix(model, sent, whole)}; expected the weights of version {want}, whole"
            )

    def send(v: int) -> None:
        before = receiver.version
        sender.send(sent[v], version=v)
        if receiver.version != before:
            raise _fail(
                f"send(version={v}) changed receiver.version from {before!r} to "
                f"{receiver.version!r} before any receive(); expected it unchanged until then"
            )
        unadopted.append(v)
        between(f"after send(version={v}) and before receive()")

    def receive(what: str, allowed: tuple[int, ...]) -> int:
        receiver.receive(timeout=10.0)
        got = receiver.version
        if got not in allowed:
            want = " or ".join(map(str, allowed))
            raise _fail(f"{what}, receiver.version is {got!r}; expected {want}")
        if _diff(model, sent[got]):
            raise _fail(
                f"{what}, receiver.version is {got} but the model holds {_held(model, sent)}"
            )
        unadopted[:] = [v for v in unadopted if v > got]
        return int(got)

    for v in (1, 2, 5):
        send(v)
        receive(f"after send(version={v}) and receive()", (v,))
    send(6)
    send(7)
    # Queue semantics apply 6 now and 7 at the next receive; latest-wins applies 7 at once.
    if receive("after send(version=6), send(version=7) and one receive()", (6, 7)) == 6:
        between("after send(version=6), send(version=7) and one receive() that adopted 6")
        receive("after send(version=6), send(version=7) and two receive()s", (7,))


@requirement("WS-003")
def no_aliasing(ctx: Context) -> None:
    sender, receiver, model, source = _setup(ctx)
    _sync(sender, receiver, source, 1)
    snapshot = {n: t.clone() for n, t in source.items()}
    with torch.no_grad():
        for t in source.values():
            t.add_(1)
    _expect_equal(model, snapshot, "after the sender changed its tensors in place following a sync")


def _rejects(
    ctx: Context, change: Callable[[Weights], Weights], what: str, name: str | None = None
) -> None:
    """A bad send must raise naming the tensor (default: the last one) and change nothing."""
    sender, receiver, model, source = _setup(ctx)
    name = name or _last(source)
    _sync(sender, receiver, source, 1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    # The version the receiver itself reports, not the one sent: a receiver whose version is
    # wrong after a good sync breaks WS-002, not this requirement.
    version_before = receiver.version
    other = {n: t + 0.5 for n, t in source.items()}
    bad = change(other)
    problems: list[str] = []
    try:
        sender.send(bad, version=2)
        receiver.receive(timeout=1.0)
    except Exception as e:
        if name not in str(e):
            problems.append(f"raised {type(e).__name__} without naming {name!r}: {str(e)[:200]}")
    else:
        problems.append("was accepted")
    try:
        changed = _diff(model, before)
        version = receiver.version
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
        raise _fail(f"weights with {what}: " + "; ".join(problems))


def _last(weights: Weights) -> str:
    return list(weights)[-1]


@requirement("WS-004")
def shape_mismatch_rejected(ctx: Context) -> None:
    def change(w: Weights) -> Weights:
        n = _last(w)
        return {**w, n: torch.cat([w[n], w[n][:1]])}

    _rejects(ctx, change, "the last tensor one row too long")


@requirement("WS-005")
def dtype_mismatch_rejected(ctx: Context) -> None:
    _rejects(ctx, lambda w: {**w, _last(w): w[_last(w)].double()}, "the last tensor as float64")


@requirement("WS-006")
def names_checked(ctx: Context) -> None:
    _rejects(
        ctx, lambda w: {n: t for n, t in w.items() if n != _last(w)}, "the last tensor missing"
    )
    _rejects(
        ctx,
        lambda w: {**w, "model.extra_head.weight": torch.zeros(2)},
        "an unknown name",
        "model.extra_head.weight",
    )


@requirement("WS-007")
def latency_reported(ctx: Context) -> None:
    sender, receiver, _model, source = _setup(ctx)
    _sync(sender, receiver, source, 1)
    s = getattr(receiver, "last_sync_s", None)
    if not isinstance(s, (int, float)) or not s >= 0:
        raise _fail(f"receiver.last_sync_s is {s!r} after a sync; expected seconds (a number >= 0)")


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
