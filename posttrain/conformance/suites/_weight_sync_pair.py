"""One sender/receiver pair of the weight-sync suite: built, synced, and read back.

With capability ``cross_process`` the factory ships the model to the receiving process, and
every check reads the receiver's weights back through ``receiver.state_dict()``.
"""

from __future__ import annotations

from typing import Any

from posttrain.conformance.context import Context
from posttrain.conformance.suites._compare import bits_equal
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._weight_sync_domains import MODELS, Weights


class Remote:
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


def setup(ctx: Context, kind: str = "float32") -> tuple[Any, Any, Any, Weights]:
    build = MODELS[kind]
    receiver_model = build(ctx.seed)
    source = {n: t.detach().clone() for n, t in build(ctx.seed + 1).state_dict().items()}
    pair = ctx.make(receiver_model)
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise _fail(
            f"the factory returned {type(pair).__name__}, expected a (sender, receiver) tuple"
        )
    model: Any = Remote(pair[1]) if "cross_process" in ctx.capabilities else receiver_model
    return pair[0], pair[1], model, source


def sync(sender: Any, receiver: Any, weights: Weights, version: int) -> None:
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


def diff(model: Any, weights: Weights) -> list[str]:
    own = model.state_dict()
    return [
        n
        for n, t in weights.items()
        if n not in own or not bits_equal(own[n].detach().cpu(), t.detach().cpu())
    ]


def expect_equal(model: Any, weights: Weights, what: str) -> None:
    bad = diff(model, weights)
    if bad:
        raise _fail(
            f"{what}: {len(bad)} of {len(weights)} tensors differ from what was sent, e.g. {bad[:3]}"
        )
