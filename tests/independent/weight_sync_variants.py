"""One-bug weight syncs written from ``specs/weight_sync-v1.md`` alone, to measure the kit's reach.

Each variant changes one thing in a correct design: the queue and latest-wins designs of
:mod:`tests.independent.weight_syncs`, or :func:`drain_newest_pair` below (a queue whose
``receive`` applies the newest pending send and drops the older ones, which WS-002 allows).
Each docstring names the bug, a system that shipped a bug of that kind (or says it is
plausible) and the requirement sentence it breaks; ``demo_<name>()`` shows the bug with plain
code against that sentence (True when the bug shows).

Example:
    >>> m = torch.nn.Linear(2, 1)
    >>> tx, rx = drain_newest_pair(m)
    >>> for v in (1, 2):
    ...     tx.send({"weight": torch.full((1, 2), float(v)), "bias": torch.zeros(1)}, version=v)
    >>> rx.receive(timeout=1.0); rx.version
    2
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from posttrain.contracts import Implementation
from tests.independent.weight_syncs import (
    QueueReceiver,
    QueueSender,
    WeightsRejected,
    weights_problem,
)

__all__ = ["BASES", "DEMOS", "VARIANTS", "drain_newest_pair"]

_Weights = Mapping[str, torch.Tensor]


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _weights(m: torch.nn.Module, fill: float | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        k: (torch.full_like(v, fill) if fill is not None else torch.randn(v.shape, generator=g))
        for k, v in m.state_dict().items()
    }


# ---------------------------------------------------------------------------------------------
# A further correct base: drain the queue, apply the newest


class DrainNewestReceiver(QueueReceiver):
    """Applies the newest of the pending sends and drops the older ones (latest wins)."""

    def receive(self, timeout: float | None = None) -> None:
        """Wait for a first send, then take everything pending and apply the newest."""
        try:
            pending = [self._pending.get(timeout=timeout)]
        except queue.Empty:
            raise TimeoutError(f"receive: no weights were sent within {timeout} s") from None
        while True:
            try:
                pending.append(self._pending.get_nowait())
            except queue.Empty:
                break
        version, weights = self._newest(pending)
        t0 = time.perf_counter()
        self._apply(weights)
        self._set_version(version)
        self.last_sync_s = time.perf_counter() - t0

    def _newest(
        self, pending: list[tuple[int, dict[str, torch.Tensor]]]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        return max(pending, key=lambda vw: vw[0])


def drain_newest_pair(model: torch.nn.Module) -> tuple[QueueSender, DrainNewestReceiver]:
    """A sender that copies and queues, and a receiver that applies the newest pending send."""
    rx = DrainNewestReceiver(model)
    return QueueSender(rx), rx


# ---------------------------------------------------------------------------------------------
# The variants


class _DeltaReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, w in weights.items():
                if torch.equal(own[name], w):  # "unchanged": skip the copy
                    continue
                own[name].copy_(w)


def delta_skip_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-001, "MUST equal w bit-exactly"): the receiver skips tensors that compare
    equal to what it holds (a delta sync), but ``==`` holds -0.0 equal to +0.0, so a sent -0.0
    (a ReLU'd or sign-flipped zero, an optimizer's ``-lr * 0``) stays +0.0. Plausible: the
    change-detection weight syncs of the "only send what changed" kind."""
    rx = _DeltaReceiver(model)
    return QueueSender(rx), rx


def demo_delta_skip() -> bool:
    m = _linear()
    with torch.no_grad():
        m.bias.zero_()
    tx, rx = delta_skip_pair(m)
    w = _weights(m)
    w["bias"] = torch.full_like(m.bias, -0.0)
    tx.send(w, version=1)
    rx.receive(timeout=1.0)
    return not bool(torch.signbit(m.bias).all())


class _Bf16WireSender(QueueSender):
    def _payload(self, weights: _Weights) -> dict[str, torch.Tensor]:
        # Halve the bytes on the wire; cast back to the receiver's dtype on arrival.
        return {
            k: v.detach().to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v.clone()
            for k, v in weights.items()
        }


def bf16_wire_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-001, "MUST equal w bit-exactly"): float32 weights travel as bfloat16 and
    are cast back, so the generator serves rounded weights. Plausible: sync paths that cast
    to a transfer or inference dtype while the trainer keeps fp32 weights, the source of
    trainer-vs-inference mismatches RL stacks chase."""
    rx = QueueReceiver(model)
    return _Bf16WireSender(rx), rx


def demo_bf16_wire() -> bool:
    m = _linear()
    tx, rx = bf16_wire_pair(m)
    w = _weights(m)
    tx.send(w, version=1)
    rx.receive(timeout=1.0)
    return not torch.equal(m.weight, w["weight"])


class _FlatBucketSender(QueueSender):
    def _payload(self, weights: _Weights) -> dict[str, torch.Tensor]:
        # Each tensor goes into the bucket as the raw run of its storage, unpacked by shape.
        return {
            k: v.detach().as_strided((v.numel(),), (1,)).clone().view(v.shape)
            for k, v in weights.items()
        }


def flat_bucket_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-001, "MUST equal w bit-exactly"): weights are packed into one flat
    bucket (as bucketed NCCL broadcasts do) by each tensor's raw storage run, read with
    contiguous strides, so a non-contiguous tensor (a transposed ``lm_head`` view, a
    ``w.t()`` from a checkpoint conversion) arrives scrambled. Plausible: the class of
    raw-buffer copies that ignore strides."""
    rx = QueueReceiver(model)
    return _FlatBucketSender(rx), rx


def demo_flat_bucket() -> bool:
    m = _linear()
    tx, rx = flat_bucket_pair(m)
    w = _weights(m)
    w["weight"] = w["weight"].t().contiguous().t()  # same values, column-major strides
    tx.send(w, version=1)
    rx.receive(timeout=1.0)
    return not torch.equal(m.weight, w["weight"])


class _LexicographicReceiver(DrainNewestReceiver):
    def _newest(
        self, pending: list[tuple[int, dict[str, torch.Tensor]]]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        return max(pending, key=lambda vw: str(vw[0]))  # versions as keys of a text store


def lexicographic_newest_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-002, "applies the next pending send or the newest, dropping older
    ones"): the newest pending send is chosen by its version *as text*, so with 9 and 10
    pending, "9" wins, 10 is dropped, and the model stays on 9 until the next send. The
    text-vs-numeric ordering trap (``checkpoint-9`` > ``checkpoint-10``) HF Trainer's
    checkpoint rotation avoids with a numeric sort, here on versioned weights. Plausible."""
    rx = _LexicographicReceiver(model)
    return QueueSender(rx), rx


def demo_lexicographic_newest() -> bool:
    m = _linear()
    tx, rx = lexicographic_newest_pair(m)
    for v in (9, 10):
        tx.send(_weights(m, float(v)), version=v)
    rx.receive(timeout=1.0)
    return rx.version != 10


class _FirstDtypeSender(QueueSender):
    def _problem(self, weights: _Weights) -> str | None:
        problem = weights_problem(self._rx.model, weights, dtypes=False)
        if problem is not None:
            return problem
        own = self._rx.model.state_dict()
        name, w = next(iter(weights.items()))  # "the model's dtype": one tensor speaks for all
        if w.dtype != own[name].dtype:
            return f"weights: {name!r} expected dtype {own[name].dtype}, found {w.dtype}"
        return None


def first_dtype_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-005, "Weights with a wrong dtype MUST raise an error naming the
    parameter"): the dtype is checked on the first tensor only, as if the model had one dtype
    (``model_config.dtype``), and ``copy_`` silently casts the others: a float64 tensor later
    in the mapping goes through. vLLM-style engines assume one dtype per model; mixed-precision
    models (fp32 norms or router weights) break that."""
    rx = QueueReceiver(model)
    return _FirstDtypeSender(rx), rx


def demo_first_dtype() -> bool:
    m = _linear()
    tx, _rx = first_dtype_pair(m)
    w = _weights(m)
    w["bias"] = w["bias"].double()
    try:
        tx.send(w, version=1)
    except WeightsRejected:
        return False
    return True


class _MillisecondReceiver(QueueReceiver):
    def receive(self, timeout: float | None = None) -> None:
        super().receive(timeout)
        self.last_sync_s *= 1000.0  # the timer's milliseconds, under the seconds name


def millisecond_latency_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-007, "SHOULD report the wall time of its last sync in seconds"): the
    receiver reports milliseconds under ``last_sync_s`` (a timer helper returning ms, the
    unit mix-up dashboards of sync latency are full of). Plausible."""
    rx = _MillisecondReceiver(model)
    return QueueSender(rx), rx


def demo_millisecond_latency() -> bool:
    m = _linear()
    tx, rx = millisecond_latency_pair(m)
    tx.send(_weights(m), version=1)
    t0 = time.perf_counter()
    rx.receive(timeout=1.0)
    wall = time.perf_counter() - t0
    return float(rx.last_sync_s) > wall


class _AllBuffersSender(QueueSender):
    def _problem(self, weights: _Weights) -> str | None:
        model = self._rx.model
        for name, _b in model.named_buffers():  # non-persistent buffers too
            if name not in weights:
                return f"weights: {name!r} is missing"
        return weights_problem(model, weights)


def all_buffers_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-001: a ``state_dict()`` send must sync): the sender checks the weights
    against ``named_buffers()``, which lists non-persistent buffers too (Llama's rotary
    ``inv_freq``, non-persistent in recent transformers), so a full ``state_dict()`` is
    refused as missing them. The same state_dict / named_buffers mismatch is why vLLM's Llama
    loader skips ``rotary_emb.inv_freq`` by name."""
    rx = QueueReceiver(model)
    return _AllBuffersSender(rx), rx


class _WithRotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)


def demo_all_buffers() -> bool:
    m = _WithRotary()
    tx, _rx = all_buffers_pair(m)
    try:
        tx.send({k: v.clone() for k, v in m.state_dict().items()}, version=1)
    except WeightsRejected:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Declarations


def _impl(factory: Any) -> Implementation:
    return Implementation("weight_sync", factory, name=f"independent.variants.{factory.__name__}")


BASES: dict[str, Implementation] = {"drain_newest": _impl(drain_newest_pair)}

# name -> (requirement id the bug breaks, declaration)
VARIANTS: dict[str, tuple[str, Implementation]] = {
    "delta_skip": ("WS-001", _impl(delta_skip_pair)),
    "bf16_wire": ("WS-001", _impl(bf16_wire_pair)),
    "flat_bucket": ("WS-001", _impl(flat_bucket_pair)),
    "lexicographic_newest": ("WS-002", _impl(lexicographic_newest_pair)),
    "first_dtype": ("WS-005", _impl(first_dtype_pair)),
    "millisecond_latency": ("WS-007", _impl(millisecond_latency_pair)),
    "all_buffers": ("WS-001", _impl(all_buffers_pair)),
}

DEMOS: dict[str, Callable[[], bool]] = {
    "delta_skip": demo_delta_skip,
    "bf16_wire": demo_bf16_wire,
    "flat_bucket": demo_flat_bucket,
    "lexicographic_newest": demo_lexicographic_newest,
    "first_dtype": demo_first_dtype,
    "millisecond_latency": demo_millisecond_latency,
    "all_buffers": demo_all_buffers,
}
