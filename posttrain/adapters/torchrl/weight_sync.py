"""TorchRL's weight transports as ``WeightSenderV1``/``WeightReceiverV1`` pairs.

Three in-process paths, each run raw (only the call shape mapped) and adapted:

- ``SharedMemWeightSyncScheme`` and ``MultiProcessWeightSyncScheme``: sender and receiver ends
  of one scheme in this process (the receiver end is what a collector worker would hold; its
  background thread applies what the sender sends, through shared memory or a queue);
- ``VanillaWeightUpdater``: the path a local collector's ``update_policy_weights_`` takes.

TorchRL's transports carry no version and take weights as a nested ``TensorDict``; the raw
shim converts a state dict to that form and keeps the version beside the transport. The
scheme's sender is initialised from a clone of the receiver's weights, never from a model:
``init_on_sender(model=...)`` makes the receiver share the trainer's storage.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain._dtypes import dtype_name

SEND_TIMEOUT_S = 10.0
"""How long a raw ``send`` may block: TorchRL's sync send waits for an ack forever."""


def _nested(weights: Mapping[str, torch.Tensor]) -> TensorDictBase:
    """A state dict as the nested TensorDict TorchRL's transports take (keys split at dots)."""
    out: TensorDictBase = TensorDict(dict(weights)).unflatten_keys(".")
    return out


def _call_with_timeout(fn: Callable[[], Any], timeout: float, what: str) -> None:
    """Run ``fn`` in a daemon thread; raise its error, or TimeoutError if it never returns."""
    box: dict[str, BaseException | None] = {}

    def target() -> None:
        try:
            fn()
            box["err"] = None
        except BaseException as e:  # handed to the caller below
            box["err"] = e

    t = threading.Thread(target=target, daemon=True, name=f"posttrain-{what}")
    t.start()
    t.join(timeout)
    if "err" not in box:
        raise TimeoutError(f"{what} did not return within {timeout:.0f} s (no acknowledgement)")
    err = box["err"]
    if err is not None:
        raise err


class TorchRLReceiver:
    """The receiving end: the model TorchRL writes into, and the version last sent to it.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> sender, receiver = weight_sync_pair(model, "vanilla")
        >>> sender.send({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, version=5)
        >>> receiver.version  # the weights are in; the version is adopted on receive()
        0
        >>> receiver.receive(); receiver.version, bool((receiver.model.weight == 0).all())
        (5, True)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pending: Callable[[], tuple[int, float]],
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.model = model
        self._pending = pending
        self._version = 0
        self.last_sync_s: float | None = None
        # TorchRL's receiving end polls in a background thread until shut down; stop it when
        # this end is closed or dropped, or every forgotten pair keeps a core busy.
        self._close = weakref.finalize(self, close)

    def close(self) -> None:
        """Stop TorchRL's receiving end (idempotent)."""
        self._close()

    def receive(self, timeout: float | None = None) -> None:
        """Adopt the version of the last completed send (TorchRL applied the weights then)."""
        self._version, self.last_sync_s = self._pending()

    @property
    def version(self) -> int:
        """The version of the weights the model holds."""
        return self._version


class TorchRLSender:
    """The raw sending end: ``send(weights, version=v)`` mapped onto TorchRL's call.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> model, twin = tiny_causal_lm(seed=0), tiny_causal_lm(seed=1)
        >>> sender, receiver = weight_sync_pair(model, "shared_mem")
        >>> sender.send(twin.state_dict(), version=7); receiver.receive(); receiver.version
        7
        >>> receiver.close()
    """

    def __init__(self, push: Callable[[TensorDictBase], Any], name: str) -> None:
        self._push = push
        self.name = name
        self._done = (0, 0.0)

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Push ``weights`` through TorchRL; record ``version`` once TorchRL returns."""
        td = _nested(weights)
        t0 = time.perf_counter()
        _call_with_timeout(lambda: self._push(td), SEND_TIMEOUT_S, f"{self.name}.send")
        self._done = (version, time.perf_counter() - t0)

    def completed(self) -> tuple[int, float]:
        """The version and duration of the last send that returned."""
        return self._done


class CheckedSender:
    """Makes a TorchRL transport conform: names, shapes and dtypes checked before any write.

    TorchRL's transports copy with tensordict's ``update_``: a missing or unknown name is
    skipped, a wrong dtype is cast, and a wrong shape fails part-way with the tensors before
    it already overwritten (``MultiProcessWeightSyncScheme`` then never acknowledges, so a
    synchronous ``send`` blocks forever). Checking first makes every send all-or-nothing.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> model = tiny_causal_lm()
        >>> sender, receiver = weight_sync_pair(model, "vanilla", adapted=True)
        >>> w = {k: v.clone() for k, v in model.state_dict().items()}
        >>> sender.send(w, version=3); receiver.receive(); receiver.version
        3
        >>> w["lm_head.weight"] = w["lm_head.weight"].double()
        >>> sender.send(w, version=4)
        Traceback (most recent call last):
        ...
        ValueError: weights rejected (receiver unchanged): lm_head.weight: expected float32 [64, 32], found float64 [64, 32]
    """

    def __init__(self, raw: TorchRLSender, model: torch.nn.Module) -> None:
        self.raw = raw
        self._signature = weight_signature(model)

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Check ``weights`` against the receiver's model, then send them."""
        problems = weight_problems(self._signature, weights)
        if problems:
            raise ValueError("weights rejected (receiver unchanged): " + "; ".join(problems))
        # torch.distributed sends only contiguous tensors (a transposed or strided view raises
        # there); a contiguous one is passed as it is.
        self.raw.send({n: t.contiguous() for n, t in weights.items()}, version=version)

    def completed(self) -> tuple[int, float]:
        """The version and duration of the last send that returned."""
        return self.raw.completed()


def weight_signature(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """Name -> (dtype, shape) of every tensor in ``model.state_dict()``.

    Example:
        >>> weight_signature(torch.nn.Linear(3, 2))
        {'weight': (torch.float32, torch.Size([2, 3])), 'bias': (torch.float32, torch.Size([2]))}
    """
    return {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}


def weight_problems(
    signature: Mapping[str, tuple[torch.dtype, torch.Size]],
    weights: Mapping[str, torch.Tensor],
) -> list[str]:
    """Every way ``weights`` differ from ``signature``: missing, unknown, wrong dtype or shape.

    Example:
        >>> sig = {"w": (torch.float32, torch.Size([2]))}
        >>> weight_problems(sig, {"w": torch.zeros(3), "b": torch.zeros(1)})
        ['b: not a parameter or buffer of the model', 'w: expected float32 [2], found float32 [3]']
    """
    problems = [f"{k}: missing" for k in signature if k not in weights]
    problems += [
        f"{k}: not a parameter or buffer of the model" for k in weights if k not in signature
    ]
    for k, v in weights.items():
        if k in signature and (v.dtype, v.shape) != signature[k]:
            dt, shape = signature[k]
            problems.append(
                f"{k}: expected {dtype_name(dt)} {list(shape)}, found {dtype_name(v.dtype)} {list(v.shape)}"
            )
    return problems


def _scheme_push(
    kind: str, model: torch.nn.Module
) -> tuple[Callable[[TensorDictBase], Any], Callable[[], None]]:
    with optional_deps():
        from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    scheme = SharedMemWeightSyncScheme() if kind == "shared_mem" else MultiProcessWeightSyncScheme()
    start = TensorDict.from_module(model).data.clone()  # a model here would alias its storage
    scheme.init_on_sender(weights=start, devices=[torch.device("cpu")])
    receiving = copy.copy(scheme)  # what pickling the scheme to a worker gives the worker
    receiving.init_on_receiver(model_id="policy", model=model, worker_idx=0)
    scheme.connect()
    receiving.connect(worker_idx=0)
    return (lambda td: scheme.send(td)), receiving.shutdown


def _vanilla_push(model: torch.nn.Module) -> Callable[[TensorDictBase], Any]:
    with optional_deps():
        from torchrl.collectors import VanillaWeightUpdater

    updater = VanillaWeightUpdater(policy_weights=TensorDict.from_module(model).data)

    def push(td: TensorDictBase) -> None:
        with torch.no_grad():
            updater.push_weights(td)

    return push


TRANSPORTS = {
    "shared_mem": "SharedMemWeightSyncScheme",
    "multiprocess": "MultiProcessWeightSyncScheme",
    "vanilla": "VanillaWeightUpdater",
}
"""The TorchRL transports :func:`weight_sync_pair` builds, by short name."""


def weight_sync_pair(
    receiver_model: torch.nn.Module, transport: str, *, adapted: bool = False
) -> tuple[Any, TorchRLReceiver]:
    """A (sender, receiver) pair over one of TorchRL's transports (see ``TRANSPORTS``).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> model, twin = tiny_causal_lm(seed=0), tiny_causal_lm(seed=1)
        >>> sender, receiver = weight_sync_pair(model, "vanilla")
        >>> sender.send(twin.state_dict(), version=1); receiver.receive()
        >>> bool(torch.equal(model.lm_head.weight, twin.lm_head.weight)), receiver.version
        (True, 1)
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {sorted(TRANSPORTS)}, found {transport!r}")
    if transport == "vanilla":
        push, close = _vanilla_push(receiver_model), (lambda: None)
    else:
        push, close = _scheme_push(transport, receiver_model)
    raw = TorchRLSender(push, TRANSPORTS[transport])
    receiver = TorchRLReceiver(receiver_model, raw.completed, close)
    return (CheckedSender(raw, receiver_model) if adapted else raw), receiver
