"""Contract ``weight_sync`` v1: move a policy's weights from the trainer to a generator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from posttrain.contracts.contract import Capability, Contract
from posttrain.contracts.requirements import Level, Requirement


class WeightSenderV1(Protocol):
    """The trainer side: publishes a full set of named weights under a version.

    TorchRL's transports disagree on ``send``/``send_weights`` signatures; this one is fixed:
    named tensors plus an explicit, increasing version.

    Example:
        >>> def publish(sender: WeightSenderV1, model, step: int) -> None:
        ...     sender.send(model.state_dict(), version=step)
    """

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> Any:
        """Publish ``weights`` as ``version``; validated against the receiver before any write."""
        ...


class WeightReceiverV1(Protocol):
    """The generator side: applies published weights to its model.

    Example:
        >>> def refresh(receiver: WeightReceiverV1) -> int:
        ...     receiver.receive(timeout=5.0)
        ...     return receiver.version
    """

    def receive(self, timeout: float | None = None) -> Any:
        """Apply pending weights to the model, waiting at most ``timeout`` seconds."""
        ...

    @property
    def version(self) -> int:
        """The version of the weights the model holds now.

        Between a ``send`` and the ``receive()`` that adopts it the model still holds this
        version's weights, unchanged. Under capability ``applies_on_send`` the send has already
        written them: until that ``receive()`` the model holds either this version's weights
        or the newly sent ones, each whole (never a mix of two sends); after it, the weights
        and the version agree again.
        """
        ...


_M, _S = Level.MUST, Level.SHOULD

WEIGHT_SYNC = Contract(
    id="weight_sync",
    title="Weight synchronisation",
    purpose=(
        "Copies the trainer's policy weights into the model a rollout source generates with, "
        "and says which version it holds. A failed sync must never leave a half-updated model. "
        "Versions rise: a send whose version is not above every version sent before is out of "
        "scope (an implementation may refuse it or apply it; the suite sends rising versions "
        "only, WS-002 holding for whatever version the receiver reports)."
    ),
    protocol=WeightSenderV1,
    extra_protocols=(WeightReceiverV1,),
    version="1.5",
    factory="factory(receiver_model: torch.nn.Module) -> tuple[WeightSenderV1, WeightReceiverV1]",
    capabilities=(
        Capability(name="cross_process", text="Sender and receiver live in different processes.",
            undeclared="Both ends are checked in this process: every check reads the receiver's model directly (WS-001 to WS-007); WS-008 does not apply."),
        Capability(name="cuda", text="The receiver's model lives on a CUDA device.",
            undeclared="The receiver's model is checked on the CPU (WS-001 to WS-007); WS-009 does not apply."),
        Capability(name="applies_on_send", text="`send` writes into the receiver's model before `receive`; `receive` only adopts the version (WS-002 says what holds before that `receive()`); since 1.3.",
            undeclared="Between a send and the `receive()` that adopts it the model MUST hold the weights of the version `receiver.version` reports, unchanged (WS-002, after every send of its random sequences)."),
    ),
    requirements=(
        Requirement(id="WS-001", level=_M, title="bit-exact after sync",
            text="After `send(w, version=v)` and `receive()`, every receiver parameter and persistent buffer (every tensor of its `state_dict`) MUST equal `w` bit-exactly.", tightened=("1.2", "1.4", "1.5"),
            domain="The sent mapping's names in every order (the receiver's own, reversed, neighbouring same-shaped tensors swapped, then random permutations); its tensors contiguous, as views at an offset into one flat buffer, or non-contiguous; values random plus NaN (both signs), -0.0, +-inf, a subnormal and 3e38 written first; pairs of syncs whose second sends the first's values (half of them zeros, NaNs in every other tensor) with every zero's and NaN's sign and every NaN's lowest payload bit flipped: equal under `==`, other bits; the receiver's model in float32 and bfloat16 (float16 and float64 from depth 2; under `cross_process` the other dtypes from depth 2 only); each sync on the same pair under a new version. A valid send or receive that raises fails this requirement."),
        Requirement(id="WS-002", level=_M, title="version propagates", tightened=("1.1", "1.3", "1.4", "1.5"),
            text="After a sync, `receiver.version` MUST equal the version sent, and the model MUST hold exactly the weights sent with the version `receiver.version` reports, also when several sends precede one `receive()` (which applies the next pending send or the newest, dropping older ones: either is allowed) and also between a send and the `receive()` that adopts it (the model unchanged until then); a send MUST NOT change `receiver.version` before a `receive()`. Under capability `applies_on_send` the model MAY hold a newer send's weights before that `receive()`, but MUST then hold one send's weights whole, never a mix of two sends.", depends_on=("WS-001",),
            domain="The fixed sequence 1, 2, 5 (each received), then several sends pending at once across digit counts and 2**31 (6, 7; 8, 9, 10; 98, 99, 100, 101; 2**31 - 1, 2**31, 2**31 + 1), each group received until none is pending, every receive() adopting the next pending send or the newest; then random sequences of 12 steps (more with depth), each on a new pair, starting above version 0, 7, 97 or 2**31 - 3: sends with version gaps 1, 2, 9 and 2**31, of fresh tensors or of a live trainer module's `state_dict()` changed in place since its last send (the same tensor objects, new values); `receive()` with sends pending (one or several: the version it adopts is the next or the newest of them) and with nothing pending (`timeout=0.01`, which MAY raise `TimeoutError`); version and weights compared with the model of the spec after every step."),
        Requirement(id="WS-003", level=_M, title="no aliasing",
            text="Changing the sender's tensors after a sync MUST NOT change the receiver's model.", depends_on=("WS-001",), tightened=("1.4", "1.5"),
            domain="After one sync, every sent tensor changed in place, and again after a second sync of a fresh mapping; then random sequences of sends (fresh or a live trainer's `state_dict()`), receives and in-place changes (+1, -0.5, +1e6) of every tensor sent under a version already adopted or dropped; the receiver's model compared with itself before each change."),
        Requirement(id="WS-004", level=_M, title="shape mismatch rejected atomically",
            text="Weights with a wrong shape MUST raise an error naming the parameter and MUST leave the receiver's model and version unchanged.", depends_on=("WS-001",), tightened=("1.4",),
            domain="Any one tensor of the state dict (first, middle, last, a persistent buffer) sent one row longer or shorter, flattened, reshaped with the same element count (transposed, or rows doubled and columns halved) or with a leading 1; on one pair synced once, each bad send under a new version."),
        Requirement(id="WS-005", level=_M, title="dtype mismatch rejected atomically",
            text="Weights with a wrong dtype MUST raise an error naming the parameter and MUST leave the receiver unchanged.", depends_on=("WS-001",), tightened=("1.4",),
            domain="Any one tensor sent as float64, float16, bfloat16, int32 (float32's width), int64 or bool; on one pair synced once, each bad send under a new version."),
        Requirement(id="WS-006", level=_M, title="names checked atomically",
            text="Weights with a missing or unknown name MUST raise an error naming it and MUST leave the receiver unchanged.", depends_on=("WS-001",), tightened=("1.4",),
            domain="Any one name missing, an unknown name added, or any one name renamed (as many names as the model's: the error may name either); on one pair synced once, each bad send under a new version."),
        Requirement(id="WS-007", level=_S, title="latency reported", tightened=("1.4",),
            text="The receiver SHOULD report the wall time of its last sync in seconds as `last_sync_s`.", depends_on=("WS-001",),
            domain="One sync of the suite's model; `last_sync_s` read right after it, at most the wall time of the send and receive that made it."),
        Requirement(id="WS-008", level=_M, title="cross-process sync", capability="cross_process",
            text="Across processes, WS-001 and WS-002 MUST hold for a receiver in another process.", depends_on=("WS-001",),
            domain="One sync of the suite's float32 model to a receiver in another process, read back through `receiver.state_dict()` (WS-001 to WS-006 run their domains through it too)."),
        Requirement(id="WS-009", level=_M, title="CUDA receiver", capability="cuda",
            text="A receiver model on CUDA MUST end bit-exact with CPU weights sent to it.", depends_on=("WS-001",),
            domain="One sync of CPU float32 weights into the suite's model moved to CUDA."),
    ),
)  # fmt: skip
