"""Round-three blind one-bug weight syncs, written from ``specs/weight_sync-v1.md`` alone.

Each variant changes one thing in a correct design of :mod:`tests.independent.weight_syncs`
(the queue design, :func:`queue_pair`, or the latest-wins mailbox, :func:`mailbox_pair`).
Each docstring names the bug, a system that shipped a bug of that kind (or says it is
plausible) and the requirement sentence it breaks; ``DEMOS[name]()`` shows the bug with plain
code against that sentence (True when the bug shows). Run by tests/conformance/independent/test_variants_by_contract.py.

Measured (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; filled in below after the run):

| variant | breaks | outcome | base on that id |
|---|---|---|---|
| shared_int_version | WS-002 | caught (FAIL) | PASS |
| cpu_staging | WS-002 | caught (FAIL) | PASS |
| summed_latency | WS-007 | caught (FAIL) | PASS |
| byte_width_dtype | WS-005 | caught (FAIL) | PASS |
| prefix_stripping | WS-006 | caught under WS-001 (FAIL; WS-006 blocked by it) | PASS |
| finite_guard | WS-001 | caught (FAIL) | PASS |

Remeasured under weight_sync 1.6, whose domains widened after the first measurement (a
training step changing the sent tensors right after send, latency read after many syncs, a
model holding every dtype, names under wrapper prefixes); before it the four in the middle
passed.

Messages:

- shared_int_version: WS-002: after a receive() with versions [2147483648, 2147483649] sent
  since the last, receiver.version is -2147483648; expected 2147483648 or 2147483649 (the next
  pending send or the newest) (see specs/weight_sync-v1.md#WS-002)
- cpu_staging: WS-002: after a receive() with versions [1] sent since the last:
  receiver.version is 1 but the model holds weights of none of them; it holds the values the
  tensors sent as version 1 have now, changed in place after that send returned: expected the
  weights as they were at the send (see specs/weight_sync-v1.md#WS-002)
- summed_latency: WS-007: receiver.last_sync_s, read after each of the 10 syncs of this pair,
  sums to 0.003284 s, while those syncs took 0.001922 s in all by the kit's clock: it reports
  more than its last sync's wall time (a running total?); last read 0.000579805 s after a sync
  of 0.000178 s (see specs/weight_sync-v1.md#WS-007)
- byte_width_dtype: WS-005: weights with 'model.layers.0.self_attn.q_proj.weight'
  (torch.float16) as torch.bfloat16 (send(version=2)): was accepted; the receiver's model
  changed (15 tensors, e.g. ['conformance_stats', 'conformance_steps', 'conformance_mask']);
  receiver.version went from 1 to 2 (see specs/weight_sync-v1.md#WS-005)
- prefix_stripping: WS-001: send(w, version=1) of 17 tensors, the receiver's state_dict names,
  shapes and dtypes, then receive(): raised WeightsRejected: weights:
  'module._orig_mod.conformance_stats' is missing; expected the weights applied (see
  specs/weight_sync-v1.md#WS-001)
- finite_guard: WS-001: after syncing version 3 with the names in order [0, 6, 3, 2, 5, 4, 1,
  12, 8, 10, 9, 11, 7] (the receiver's own is [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),
  tensors offset_views, special values (NaN, -0.0, inf, subnormal) first: 13 of 13 tensors diff

Missed at the first measurement (weight_sync 1.5), and what the domain did not try then:

- cpu_staging: the domain apparently changes a sender's tensors in place only once their send
  was adopted or dropped (WS-003 says so; WS-002 changes the live module 'since its last send'),
  never while that send is still pending, so the alias is never seen (WS-003 run on it too:
  PASS).
- summed_latency: WS-007 makes one sync only, and after one sync the running total is the last
  sync's time.
- byte_width_dtype: WS-005 sends wrong dtypes to a float32 model only, where no wrong dtype has
  both float32's width and float-ness (float16 for bfloat16 needs a 16-bit model).
- prefix_stripping: WS-006's renames never add a wrapper prefix (module., _orig_mod.) to a name.
  (Its first version also stripped 'model.', a second bug of mine that failed WS-001 on every
  send of the suite's HF model; fixed and remeasured, the row above.)

Example:
    >>> sorted(VARIANTS)[0]
    'byte_width_dtype'
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable
from typing import Any

import torch

from posttrain.contracts import Implementation
from tests.independent.weight_syncs import (
    MailboxReceiver,
    MailboxSender,
    QueueReceiver,
    QueueSender,
    WeightsRejected,
    _Mailbox,
    _Weights,
    mailbox_pair,
    queue_pair,
    weights_problem,
)

__all__ = ["BREAKS", "DEMOS", "VARIANTS"]


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _weights(v: float) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((2, 3), v), "bias": torch.full((2,), v)}


# ---------------------------------------------------------------------------------------------


class _SharedVersionReceiver(QueueReceiver):
    """Publishes its version in a ``multiprocessing.Value('i')`` (a C int) for other workers."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._shared = multiprocessing.Value("i", 0, lock=False)

    @property
    def version(self) -> int:
        return int(self._shared.value)

    def _set_version(self, version: int) -> None:
        self._shared.value = version  # ctypes wraps silently past 2**31 - 1


def shared_int_version_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-002, "After a sync, receiver.version MUST equal the version sent"): the
    receiver keeps its version in a ``multiprocessing.Value('i')`` so that generator workers
    can read it without a lock; the C int wraps silently, so version 2**31 reads back as
    -2**31 (the step counter of a long run, or a version built from a timestamp or
    ``step * world_size + rank``). Plausible: the int32-counter overflow every long-running
    counter meets (``ctypes`` does no overflow check).
    """
    rx = _SharedVersionReceiver(model)
    return QueueSender(rx), rx


def demo_shared_int_version() -> bool:
    """Version 2**31 is reported as a negative number."""
    tx, rx = shared_int_version_pair(_linear())
    tx.send(_weights(1.0), version=2**31)
    rx.receive(timeout=1.0)
    return rx.version != 2**31


class _CpuPayloadSender(QueueSender):
    def _payload(self, weights: _Weights) -> dict[str, torch.Tensor]:
        # "Stage on the host": a copy for CUDA tensors, but ``.cpu()`` returns the tensor
        # itself when it already lives on the CPU.
        return {k: v.detach().cpu() for k, v in weights.items()}


def cpu_staging_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-002, "the model MUST hold exactly the weights sent with the version
    receiver.version reports"): the sender stages each tensor on the host with ``.cpu()``,
    which copies a CUDA tensor but returns a CPU tensor itself (documented, and the reason
    pytorch/pytorch#17553's wording was questioned), so for a CPU trainer the queued send
    aliases the trainer's live tensors: a step taken between ``send`` and ``receive`` is
    applied under the older version. Plausible (a copy that is a copy only on another
    device).
    """
    rx = QueueReceiver(model)
    return _CpuPayloadSender(rx), rx


def demo_cpu_staging() -> bool:
    """The weights applied for version 1 are those the trainer holds later, not those sent."""
    trainer = _linear()
    tx, rx = cpu_staging_pair(_linear())
    tx.send(trainer.state_dict(), version=1)
    with torch.no_grad():
        trainer.weight.add_(1.0)
    rx.receive(timeout=1.0)
    return bool(torch.equal(rx.model.state_dict()["weight"], trainer.weight))


class _SummingReceiver(QueueReceiver):
    def receive(self, timeout: float | None = None) -> None:
        try:
            version, weights = self._pending.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"receive: no weights were sent within {timeout} s") from None
        t0 = time.perf_counter()
        self._apply(weights)
        self._set_version(version)
        self.last_sync_s += time.perf_counter() - t0  # a running total, not the last sync


def summed_latency_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-007, "The receiver SHOULD report the wall time of its last sync in
    seconds as last_sync_s"): ``last_sync_s += dt``: the attribute accumulates every sync's
    time (a ``total_sync_s`` counter renamed), so it equals the last sync's time only after
    the first sync and grows without bound after. Plausible (precision of accumulation: a
    mean or a last value confused with a running sum).
    """
    rx = _SummingReceiver(model)
    return QueueSender(rx), rx


def demo_summed_latency() -> bool:
    """After many syncs, last_sync_s exceeds the wall time of the last one."""
    tx, rx = summed_latency_pair(_linear())
    for v in range(1, 201):
        tx.send(_weights(float(v)), version=v)
        rx.receive(timeout=1.0)
    t0 = time.perf_counter()
    tx.send(_weights(0.5), version=201)
    rx.receive(timeout=1.0)
    return rx.last_sync_s > time.perf_counter() - t0


def _byte_width_problem(model: torch.nn.Module, weights: _Weights) -> str | None:
    problem = weights_problem(model, weights, dtypes=False)
    if problem is not None:
        return problem
    own = model.state_dict()
    for name, w in weights.items():
        o = own[name]
        # "Same kind, same width": all a bucketed transfer needs to size its buffers.
        if w.element_size() != o.element_size() or w.is_floating_point() != o.is_floating_point():
            return f"weights: {name!r} expected dtype {o.dtype}, found {w.dtype}"
    return None


class _ByteWidthSender(MailboxSender):
    def _problem(self, weights: _Weights) -> str | None:
        return _byte_width_problem(self._rx.model, weights)


def byte_width_dtype_pair(model: torch.nn.Module) -> tuple[MailboxSender, MailboxReceiver]:
    """BUG (breaks WS-005, "Weights with a wrong dtype MUST raise an error naming the
    parameter"): the dtype check compares element width and float-ness (what sizing a
    transfer bucket needs), not the dtype, so float16 passes for bfloat16 (and back) and
    ``load_state_dict`` casts it silently: a bf16 generator fed fp16 weights loses range
    (values above 65504 became inf on the trainer side already). Plausible.
    """
    box = _Mailbox()
    rx = MailboxReceiver(model, box)
    return _ByteWidthSender(rx, box), rx


def demo_byte_width_dtype() -> bool:
    """float16 weights are accepted by a bfloat16 model."""
    model = _linear().to(torch.bfloat16)
    tx, _ = byte_width_dtype_pair(model)
    w = {k: v.to(torch.float16) for k, v in _weights(1.0).items()}
    try:
        tx.send(w, version=1)
    except WeightsRejected:
        return False
    return True


_PREFIXES = ("module.", "_orig_mod.")


def _strip(name: str) -> str:
    for p in _PREFIXES:
        name = name.removeprefix(p)
    return name


class _PrefixStrippingSender(QueueSender):
    def _problem(self, weights: _Weights) -> str | None:
        return weights_problem(self._rx.model, {_strip(k): v for k, v in weights.items()})

    def _payload(self, weights: _Weights) -> dict[str, torch.Tensor]:
        return {_strip(k): v.detach().clone() for k, v in weights.items()}


def prefix_stripping_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-006, "Weights with a missing or unknown name MUST raise an error naming
    it"): sent names are normalised by stripping the wrapper prefixes DDP/FSDP and
    ``torch.compile`` add (``module.``, ``_orig_mod.``), so a name the receiver does not have
    (``module.bias``, ``_orig_mod.lm_head.weight`` for a model whose own names carry no such
    prefix) is accepted as another. Plausible: RL stacks strip ``_orig_mod.`` and
    ``module.`` before loading trainer weights into their inference engines.
    """
    rx = QueueReceiver(model)
    return _PrefixStrippingSender(rx), rx


def demo_prefix_stripping() -> bool:
    """An unknown name, ``module.bias``, is accepted."""
    tx, _ = prefix_stripping_pair(_linear())
    w = _weights(1.0)
    w["module.bias"] = w.pop("bias")
    try:
        tx.send(w, version=1)
    except WeightsRejected:
        return False
    return True


class _FiniteOnlyReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, w in weights.items():
                if w.is_floating_point() and not bool(torch.isfinite(w).all()):
                    continue  # "never load a diverged tensor into the generator"
                own[name].copy_(w)


def finite_guard_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-001, "every receiver parameter and persistent buffer MUST equal w
    bit-exactly"): the receiver skips any tensor holding a NaN or an infinity, keeping its
    old value (a guard against a diverged trainer), while the version still moves on: the
    model then holds a mix of old and new weights under the new version. Plausible: NaN
    guards that silently drop an update instead of refusing it.
    """
    rx = _FiniteOnlyReceiver(model)
    return QueueSender(rx), rx


def demo_finite_guard() -> bool:
    """A tensor holding an inf is not applied."""
    tx, rx = finite_guard_pair(_linear())
    w = _weights(1.0)
    w["bias"][0] = float("inf")
    tx.send(w, version=1)
    rx.receive(timeout=1.0)
    return not bool(torch.equal(rx.model.state_dict()["bias"], w["bias"]))


def _impl(factory: Any) -> Implementation:
    return Implementation("weight_sync", factory, name=f"r3.{factory.__name__}")


VARIANTS: dict[str, Implementation] = {
    "shared_int_version": _impl(shared_int_version_pair),
    "cpu_staging": _impl(cpu_staging_pair),
    "summed_latency": _impl(summed_latency_pair),
    "byte_width_dtype": _impl(byte_width_dtype_pair),
    "prefix_stripping": _impl(prefix_stripping_pair),
    "finite_guard": _impl(finite_guard_pair),
}

BREAKS: dict[str, str] = {
    "shared_int_version": "WS-002",
    "cpu_staging": "WS-002",
    "summed_latency": "WS-007",
    "byte_width_dtype": "WS-005",
    "prefix_stripping": "WS-006",
    "finite_guard": "WS-001",
}

DEMOS: dict[str, Callable[[], bool]] = {
    "shared_int_version": demo_shared_int_version,
    "cpu_staging": demo_cpu_staging,
    "summed_latency": demo_summed_latency,
    "byte_width_dtype": demo_byte_width_dtype,
    "prefix_stripping": demo_prefix_stripping,
    "finite_guard": demo_finite_guard,
}

# The correct design each variant changes, for the base check on the same id.
BASES: dict[str, Implementation] = {
    "shared_int_version": _impl(queue_pair),
    "cpu_staging": _impl(queue_pair),
    "summed_latency": _impl(queue_pair),
    "byte_width_dtype": _impl(mailbox_pair),
    "prefix_stripping": _impl(queue_pair),
    "finite_guard": _impl(queue_pair),
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {
    # A receiver model whose own names carry the prefixes fails a correct sync (WS-001).
    "prefix_stripping": "WS-001",
}
