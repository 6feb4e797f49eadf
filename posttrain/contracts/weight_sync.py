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
        """Publish ``weights`` as ``version``; validated against the receiver before any write.

        What is published is the tensors' values when ``send`` returns: the caller may change
        them in place right after (a trainer's next step) without changing what arrives.
        """
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
    version="1.6",
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
            text="After `send(w, version=v)` and `receive()`, every receiver parameter and persistent buffer (every tensor of its `state_dict`) MUST equal `w` bit-exactly.", tightened=("1.2", "1.4", "1.5", "1.6"),
            domain="The sent mapping's names in every order (the receiver's own, reversed, neighbouring same-shaped tensors swapped, then random permutations); its tensors contiguous, as views at an offset into one flat buffer, or non-contiguous; values random plus NaN (both signs), -0.0, +-inf, a subnormal and 3e38 written first; pairs of syncs whose second sends the first's values (half of them zeros, NaNs in every other tensor) with every zero's and NaN's sign and every NaN's lowest payload bit flipped: equal under `==`, other bits; the receiver's model in float32 and bfloat16 (float16 and float64 from depth 2); then two more models, each synced once with its names in a random order, as views at an offset, special values first: the mixed-dtype model (float16 and bfloat16 in same-shaped tensors, float32, float64, a 0-d int64 step counter holding a value past 2**53 and a bool mask, integers drawn over their whole range) and the wrapped-names model (the suite's model under `module._orig_mod.`, beside `_orig_mod.module.weight`, `submodule.weight`, `not_orig_mod.weight` and `head.weight`); under `cross_process` the other dtypes and models from depth 2 only; each sync on the same pair under a new version. A valid send or receive that raises fails this requirement."),
        Requirement(id="WS-002", level=_M, title="version propagates", tightened=("1.1", "1.3", "1.4", "1.5", "1.6"),
            text="After a sync, `receiver.version` MUST equal the version sent, and the model MUST hold exactly the weights sent with the version `receiver.version` reports, also when several sends precede one `receive()` (which applies the next pending send or the newest, dropping older ones: either is allowed) and also between a send and the `receive()` that adopts it (the model unchanged until then); a send MUST NOT change `receiver.version` before a `receive()`. The weights sent are the tensors' values when `send` returns: the sender MAY change its tensors in place right after (a trainer's next step, as the Protocol's example sends a live model's `state_dict()`), and what a later `receive()` adopts MUST NOT change with them. Under capability `applies_on_send` the model MAY hold a newer send's weights before that `receive()`, but MUST then hold one send's weights whole, never a mix of two sends.", depends_on=("WS-001",),
            domain="The fixed sequence 1, 2, 5 (each received), then several sends pending at once across digit counts and 2**31 (6, 7; 8, 9, 10; 98, 99, 100, 101; 2**31 - 1, 2**31, 2**31 + 1), each group received until none is pending, every receive() adopting the next pending send or the newest, every send's tensors changed in place right after it returns (a trainer's next step: what a receive() adopts is the weights as they were at their send); then 5 random sequences of 12 steps (more with depth; one at depth 1 under `cross_process`, where a pair starts processes), each on a new pair of the float32, the mixed-dtype or the wrapped-names model (WS-001's), starting above version 0, 7, 97 or 2**31 - 3: sends with version gaps 1, 2, 9 and 2**31, of fresh tensors or of a live trainer module's `state_dict()` changed in place since its last send (the same tensor objects, new values), also while a send of it is pending; training steps (by 1, -0.5 or 1e6; integers step by 1, bools flip) right after a send returns or between any two calls, changing in place the trainer's live tensors and every tensor of a send not yet adopted, before the receive() that adopts it and, in another process, while the receiver applies it; `receive()` with sends pending (one or several: the version it adopts is the next or the newest of them) and with nothing pending (`timeout=0.01`, which MAY raise `TimeoutError`); version and weights compared with the model of the spec after every step."),
        Requirement(id="WS-003", level=_M, title="no aliasing",
            text="Changing the sender's tensors after a sync MUST NOT change the receiver's model.", depends_on=("WS-001",), tightened=("1.4", "1.5", "1.6"),
            domain="After one sync, every sent tensor changed in place, and again after a second sync of a fresh mapping; then 4 random sequences (more with depth; one at depth 1 under `cross_process`), each on a new pair of WS-001's three models, of sends (fresh or a live trainer's `state_dict()`), receives and in-place changes (+1, -0.5, +1e6; integers +1, bools flipped) of every tensor sent under a version already adopted or dropped; the receiver's model compared with itself before each change."),
        Requirement(id="WS-004", level=_M, title="shape mismatch rejected atomically",
            text="Weights with a wrong shape MUST raise an error naming the parameter and MUST leave the receiver's model and version unchanged.", depends_on=("WS-001",), tightened=("1.4", "1.6"),
            domain="Any one tensor of the mixed-dtype model's state dict (WS-001's: first, middle, last, a persistent buffer, the 0-d int64 step counter, the bool mask) sent one row longer or shorter, flattened, reshaped with the same element count (transposed, rows doubled and columns halved, a 0-d tensor as [1] or [1, 1]) or with a leading 1; on one pair synced once, each bad send under a new version; the error names the parameter whole (`head.weight` inside `lm_head.weight` does not count)."),
        Requirement(id="WS-005", level=_M, title="dtype mismatch rejected atomically",
            text="Weights with a wrong dtype MUST raise an error naming the parameter and MUST leave the receiver unchanged.", depends_on=("WS-001",), tightened=("1.4", "1.6"),
            domain="Any one tensor of the mixed-dtype model (WS-001's: float16, bfloat16, float32, float64, a 0-d int64 and a bool mask in one model) sent as another of float64, float32, float16, bfloat16, int64, int32, uint8 and bool, each dtype's first tensor first as the other dtype of its width (float16 for bfloat16 and back, int32 for float32, int64 for float64 and back, uint8 for bool); on one pair synced once, each bad send under a new version; the error names the parameter whole."),
        Requirement(id="WS-006", level=_M, title="names checked atomically",
            text="Weights with a missing or unknown name MUST raise an error naming it and MUST leave the receiver unchanged.", depends_on=("WS-001",), tightened=("1.4", "1.6"),
            domain="On the wrapped-names model (WS-001's): any one name missing; an unknown name added (a made-up one, or a name the model has under a wrapper prefix `module.`, `_orig_mod.`, `module._orig_mod.` or `_orig_mod.module.`, sent beside it); any one name renamed (a suffix, a wrapper prefix added, or the first `module.` or `_orig_mod.` in it taken out, at its start or mid-name: as many names as the model's, the error may name either); the mapping's names in a random order; on one pair synced once, each bad send under a new version; the error names the name whole (`head.weight` inside `module.head.weight` does not count)."),
        Requirement(id="WS-007", level=_S, title="latency reported", tightened=("1.4", "1.6"),
            text="The receiver SHOULD report the wall time of its last sync in seconds as `last_sync_s`.", depends_on=("WS-001",),
            domain="On one pair: twelve syncs in a row, three sends received until none is pending, four syncs more; then 2 random sequences of 6 steps (more with depth; under `cross_process` from depth 2), each on a new pair: runs of 1 to 6 syncs in a row, sends left pending, receives with sends pending and without. After every receive() that adopts a version `last_sync_s` is read: at most the wall time from the start of the earliest send it could adopt to that receive's return (1 ms slack), and the values read over the pair's syncs sum to at most the sum of those wall times (1 ms slack in all): a running total or a mean fails there."),
        Requirement(id="WS-008", level=_M, title="cross-process sync", capability="cross_process",
            text="Across processes, WS-001 and WS-002 MUST hold for a receiver in another process.", depends_on=("WS-001",),
            domain="One sync of the suite's float32 model to a receiver in another process, read back through `receiver.state_dict()` (WS-001 to WS-006 run their domains through it too)."),
        Requirement(id="WS-009", level=_M, title="CUDA receiver", capability="cuda",
            text="A receiver model on CUDA MUST end bit-exact with CPU weights sent to it.", depends_on=("WS-001",),
            domain="One sync of CPU float32 weights into the suite's model moved to CUDA."),
    ),
)  # fmt: skip
