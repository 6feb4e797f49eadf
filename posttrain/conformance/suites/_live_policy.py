"""One loss object on a live policy, driven statefully: the model a loss suite compares with
after every step is its formula computed from the policy's *current* weights and the batch's
*current* contents.

:func:`check_live` runs random sequences of new batches, training steps through the loss
itself, weight loads in place and in-place changes of a batch on one loss object, and scores
every held batch after every step (NLL-003, DPO-003, LOSS-003). A result kept from an earlier
call (a cache keyed by the batch, log-probs from weights since replaced, counts from an earlier
call) shows as a value or gradient that is not the formula's; the failure ends with the call
sequence as a program.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.explore import run_machine
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_kit import ATT, TOK, V
from posttrain.conformance.suites.loss_kit import loss_term as _loss_term
from posttrain.testing import tiny_causal_lm


def scaled_policy(base: Any, scale: float) -> Any:
    """A copy of ``base`` whose output head is multiplied by ``scale``.

    Example:
        >>> base = tiny_causal_lm(vocab_size=V)
        >>> big = scaled_policy(base, 2.0).get_output_embeddings().weight
        >>> bool(torch.equal(big, 2 * base.get_output_embeddings().weight))
        True
    """
    policy = copy.deepcopy(base)
    if scale != 1.0:
        with torch.no_grad():
            policy.get_output_embeddings().weight.mul_(scale)
    return policy


_LRS = (1e-3, 1e-2, 0.1)


@dataclass(frozen=True)
class _LiveSpec:
    """What :func:`check_live` was asked to check, read by its state machine's rules."""

    base: Any
    make: Callable[[Any], Any]
    batch_of: Callable[[Any, Any], TensorDictBase]
    score: Callable[[Any, Any, TensorDictBase], dict[str, tuple[float, float, float]]]
    term: str
    what: str
    formula: str
    in_place: tuple[tuple[str, ...], ...]


class _LiveState:
    """One loss object on a live policy, the batches it scores and the changes made to them.

    The rules of :func:`check_live`'s state machine, which mixes this class into a
    ``RuleBasedStateMachine`` and sets ``spec``.
    """

    spec: _LiveSpec

    def __init__(self) -> None:
        super().__init__()
        self.policy: Any = None
        self.loss: Any = None
        self.scale = 1.0
        self.batches: list[TensorDictBase] = []
        self.seen: list[dict[str, float]] = []
        self.last = "the first call"

    def build(self, scale: float, recipe: Any) -> None:
        self.scale = scale
        self.policy = scaled_policy(self.spec.base, scale)
        self.loss = self.spec.make(self.policy)
        self.new_batch(recipe)

    def new_batch(self, recipe: Any) -> None:
        if len(self.batches) < 2:
            self.batches.append(self.spec.batch_of(self.policy, replace(recipe, scale=self.scale)))
            self.seen.append({})
        self.last = f"a new batch ({len(self.batches)} held)"
        self._score_all()

    def train_step(self, i: int, lr: float) -> None:
        term = self.spec.term
        td = self.batches[i % len(self.batches)]
        value = _loss_term(self.loss(td), term)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if value.requires_grad:
            grads = torch.autograd.grad(value, params, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    if g is not None:
                        p.sub_(lr * g.sign())
        self.last = f"a training step of the policy (lr {lr:g} x the sign of d {term} / d weight)"
        self._score_all()

    def load_weights(self, seed: int, size: float) -> None:
        g = torch.Generator().manual_seed(seed)
        state = {
            k: v.detach() + size * v.detach().abs().mean() * torch.randn(v.shape, generator=g)
            for k, v in self.policy.named_parameters()
        }
        self.policy.load_state_dict(state, strict=False)  # copied into the live parameters
        self.last = f"a load of new weights into the policy in place (noise {size:g})"
        self._score_all()

    def change_in_place(self, i: int, seed: int) -> None:
        td = self.batches[i % len(self.batches)]
        g = torch.Generator().manual_seed(seed)
        tokens = td.get(TOK)  # the batch's own tensor, changed where it lies
        where = td.get(ATT).clone()
        where[:, 0] = False
        where &= torch.rand(where.shape, generator=g) < 0.5
        tokens[where] = torch.randint(1, V, (int(where.sum()),), generator=g)
        for key in self.spec.in_place:
            value = td.get(key)
            value.add_(torch.rand(value.shape, generator=g, dtype=value.dtype) - 0.5)
        also = "".join(f" and {key[-1]}" for key in self.spec.in_place)
        self.last = f"an in-place change of batch {i % len(self.batches)}'s tokens{also}"
        self._score_all()

    def _score_all(self) -> None:
        spec = self.spec
        for n, td in enumerate(self.batches):
            scored = spec.score(self.policy, self.loss, td)
            for name, (got, want, tol) in scored.items():
                if not math.isclose(got, want, rel_tol=1e-5, abs_tol=tol):
                    before = self.seen[n].get(name)
                    hint = ""
                    if before is not None and math.isclose(got, before, rel_tol=1e-7):
                        hint = (
                            f" (it is the value this loss gave the same batch before "
                            f"{self.last}: a result kept from an earlier call)"
                        )
                    raise _fail(
                        f"{spec.what}, one loss object on a live policy (output head x "
                        f"{self.scale:g}), batch {n} scored again after {self.last}: "
                        f"{name} is {got:.6g}, expected {want:.6g} ({spec.formula} computed in "
                        f"float64 from the policy's current weights and the batch's "
                        f"current contents){hint}"
                    )
                self.seen[n][name] = got


def _live_machine(live: _LiveSpec, recipes: Any, scales: tuple[float, ...]) -> type[Any]:
    """A ``RuleBasedStateMachine`` class running :class:`_LiveState`'s rules on ``live``."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

    # Made per call: hypothesis reads the rules' strategies off the class, and the recipes
    # are the caller's. rule() wraps, so the shared methods stay undecorated.
    class LivePolicy(_LiveState, RuleBasedStateMachine):
        spec = live
        build = initialize(scale=st.sampled_from(scales), recipe=recipes)(_LiveState.build)
        new_batch = rule(recipe=recipes)(_LiveState.new_batch)
        train_step = rule(i=st.integers(0, 2), lr=st.sampled_from(_LRS))(_LiveState.train_step)
        load_weights = rule(seed=st.integers(0, 2**16), size=st.sampled_from((1e-3, 0.1, 1.0)))(
            _LiveState.load_weights
        )
        change_in_place = rule(i=st.integers(0, 2), seed=st.integers(0, 2**16))(
            _LiveState.change_in_place
        )

    LivePolicy.__name__ = "LivePolicy"
    return LivePolicy


def _run_script(machine: type[Any], script: list[tuple[str, dict[str, Any]]]) -> None:
    """Run ``script``'s (rule, arguments) on one ``machine``; a failure ends with the calls."""
    state = machine()
    for n, (step, kwargs) in enumerate(script):
        try:
            getattr(state, step)(**kwargs)
        except ConformanceError as e:
            program = "\n".join(
                ["state = LivePolicy()"]
                + [
                    f"state.{name}({', '.join(f'{k}={v!r}' for k, v in kw.items())})"
                    for name, kw in script[: n + 1]
                ]
            )
            raise ConformanceError(f"{e}\ncall sequence (runnable):\n{program}") from e


def check_live(
    ctx: Context,
    make: Callable[[Any], Any],
    batch_of: Callable[[Any, Any], TensorDictBase],
    score: Callable[[Any, Any, TensorDictBase], dict[str, tuple[float, float, float]]],
    term: str,
    *,
    what: str,
    formula: str,
    recipes: Any,
    start: Any,
    scales: tuple[float, ...],
    in_place: tuple[tuple[str, ...], ...] = (),
    examples: int = 2,
    steps: int = 5,
) -> None:
    """Random sequences on one loss object built on a live policy: new batches, training steps
    (lr·sign of the gradient of ``term`` through the loss itself), weight loads in place
    (``load_state_dict``, as a weight sync does) and in-place changes of a batch's tokens (and
    of ``in_place``'s float entries), every batch scored after every step.

    ``batch_of(policy, recipe)`` builds a batch from a recipe of ``recipes`` (a strategy of
    frozen dataclasses with ``scale`` and ``seed``, its ``scale`` replaced by the sequence's,
    one of ``scales``: the factors on the policy's output head); ``score(policy, loss, td)`` gives, by name, (what the
    loss gave, the formula's float64 value from the policy's current weights, the absolute
    tolerance). A value that differs from the formula's by more than 1e-5 relative fails,
    naming the value the loss gave the same batch before, when it gives it again. A fixed
    sequence on the recipe ``start`` (output head x 1) runs first: a training step, a weight
    load and an in-place change of the batch, then a second batch and a training step on it.
    """
    base = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    spec = _LiveSpec(base, make, batch_of, score, term, what, formula, in_place)
    machine = _live_machine(spec, recipes, scales)
    # The boundary first, as a fixed sequence: each kind of change once, then a second batch.
    first = replace(start, scale=1.0)
    _run_script(
        machine,
        [
            ("build", {"scale": 1.0, "recipe": first}),
            ("train_step", {"i": 0, "lr": 0.01}),
            ("load_weights", {"seed": 1, "size": 0.1}),
            ("change_in_place", {"i": 0, "seed": 2}),
            ("new_batch", {"recipe": replace(first, seed=first.seed + 1)}),
            ("train_step", {"i": 1, "lr": 0.1}),
        ],
    )
    run_machine(ctx, machine, examples=examples, steps=steps)
