"""The rollout suite: one check per ROLL requirement (specs/rollout-v1.md).

The suite supplies a tiny real HF causal LM and four prompts; to see that new weights are in
use it loads weights that force one token, then looks at what was generated. ROLL-001 and
ROLL-003 use *scripted* weights instead (:func:`scripted_weights`): the next token depends on
the last one only, by a margin no sampler overrides, so the suite knows every response in
advance: two prompts end early with EOS (the model's pad token is EOS too, as with many real
tokenizers), and the tokens generated name the weights that generated them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain.conformance import explore
from posttrain.conformance.context import Context
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites import _rollout_life as life
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import forced_token_weights, tiny_causal_lm

V = 64
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16]]
FORCED = 42
MAX_NEW = 4
K = LLM_LAYOUT_V1.key
EOS = 2  # tiny_causal_lm's eos_token_id
_EARLY_END = {9, 16}  # prompts ending in these answer [marker, EOS]: shorter than MAX_NEW
_MARKED = 20  # scripted weights k emit 20 + k before EOS ...
_LOOPED = 40  # ... and 40 + k (repeated up to MAX_NEW) after any other token
_MARGIN = 50.0  # ~280 logits after the final norm: exp(-280) underflows, sampling is greedy


def _source(ctx: Context, total: int | None = 3) -> tuple[Any, Any]:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    return policy, ctx.make(policy, [list(p) for p in PROMPTS], total, max_new_tokens=MAX_NEW)


def scripted_weights(model: Any, k: int) -> dict[str, torch.Tensor]:
    """Weights ``k`` for a tiny Llama whose next token depends on the last token only.

    After 9 or 16 it emits ``20 + k`` and then EOS; after any other token it emits ``40 + k``.
    Like :func:`~posttrain.testing.forced_token_weights`, the residual stream is the
    embedding alone; each token's embedding is the unit vector of its class and only the class's
    next token reads it, so every response is known in advance and names ``k``.

    Example:
        >>> m = tiny_causal_lm()
        >>> _ = m.load_state_dict(scripted_weights(m, 1))
        >>> [m(input_ids=torch.tensor([[5, t]])).logits[0, -1].argmax().item() for t in (7, 9, 21)]
        [41, 21, 2]
    """
    x, y, z = 0, 1, 2  # classes: -> 40 + k, -> 20 + k, -> EOS
    out = forced_token_weights(model, _LOOPED + k)
    emb = out["model.embed_tokens.weight"]  # every row is class x's unit vector so far
    for t in (*_EARLY_END, _MARKED + k):
        emb[t, x] = 0.0
        emb[t, z if t == _MARKED + k else y] = 1.0
    head = out["lm_head.weight"]
    head[_MARKED + k, y] = _MARGIN
    head[EOS, z] = _MARGIN
    return out


def scripted_response(prompt: list[int], k: int) -> list[int]:
    """What scripted weights ``k`` generate after ``prompt`` within ``MAX_NEW`` tokens.

    Example:
        >>> scripted_response([8, 9], 0), scripted_response([5, 6, 7], 3)
        ([20, 2], [43, 43, 43, 43])
    """
    out: list[int] = []
    last = prompt[-1]
    while len(out) < MAX_NEW and last != EOS:
        last = _MARKED + k if last in _EARLY_END else EOS if last == _MARKED + k else _LOOPED + k
        out.append(last)
    return out


def _scripted_source(ctx: Context, total: int | None) -> tuple[Any, Any]:
    """A source over scripted weights 0, whose pad token is its EOS token."""
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    policy.load_state_dict(scripted_weights(policy, 0))
    policy.config.pad_token_id = EOS
    policy.generation_config.pad_token_id = EOS
    return policy, ctx.make(policy, [list(p) for p in PROMPTS], total, max_new_tokens=MAX_NEW)


def _weights_of(generated: list[int]) -> int | None:
    """Which scripted weights generated these tokens (None: no marker, or several)."""
    ks = {t - _MARKED for t in generated if _MARKED <= t < _LOOPED}
    ks |= {t - _LOOPED for t in generated if _LOOPED <= t < V}
    return ks.pop() if len(ks) == 1 else None


def _items(batch: TensorDictBase) -> list[TensorDictBase]:
    if isinstance(batch, LazyStackedTensorDict):
        return list(batch.tensordicts)
    return [batch[i] for i in range(batch.batch_size[0])]


def _rows(batch: TensorDictBase) -> list[tuple[list[int], list[bool], list[bool]]]:
    """Per item: tokens, attention mask, assistant mask (as lists)."""
    return [
        (
            it.get(K("tokens")).tolist(),
            it.get(K("attention_mask")).tolist(),
            it.get(K("assistant_mask")).tolist(),
        )
        for it in _items(batch)
    ]


def _rows_or_none(batch: TensorDictBase) -> list[tuple[list[int], list[bool], list[bool]]] | None:
    """``_rows`` of a batch that may break the layout (None when it cannot be read so)."""
    try:
        rows = _rows(batch)
    except Exception:  # a missing key or a wrong shape: the layout check reports it
        return None
    ok = all(len(t) == len(a) == len(m) for t, a, m in rows)
    return rows if ok else None


def _responses(batch: TensorDictBase) -> list[list[int]]:
    return [[t for t, a in zip(toks, asst, strict=True) if a] for toks, _att, asst in _rows(batch)]


def _generated(toks: list[int], att: list[bool]) -> list[int] | None:
    """Positions of the generated tokens: the real tokens after the prompt they start with.

    None when the real tokens start with none of the prompts (ROLL-002 reports that).
    """
    real = [j for j, a in enumerate(att) if a]
    head = [toks[j] for j in real]
    for p in PROMPTS:
        if head[: len(p)] == p:
            return real[len(p) :]
    return None


def _shift(generated: list[int], masked: list[int], width: int) -> int | None:
    """By how many positions ``masked`` is ``generated`` moved (cut at the row's ends), or None."""
    for k in (-1, 1, -2, 2):
        if masked == [j + k for j in generated if 0 <= j + k < width]:
            return k
    return None


def _spans(pos: list[int]) -> str:
    return f"{pos[0]}..{pos[-1]}" if pos else "none"


def _mask_problem(toks: list[int], att: list[bool], asst: list[bool]) -> str | None:
    """How the assistant mask differs from the generated tokens, or None when it is exact."""
    gen = _generated(toks, att)
    if gen is None:
        return None
    masked = [j for j, a in enumerate(asst) if a]
    if masked == gen:
        return None
    where = f"on positions {_spans(masked)}, the generated tokens at {_spans(gen)}"
    k = _shift(gen, masked, len(asst))
    if k is not None:
        return f"the assistant mask is shifted by {k:+d} ({where})"
    missed = [j for j in gen if j not in masked]
    extra = [j for j in masked if j not in gen]
    parts = [f"misses generated positions {missed[:10]}"] if missed else []
    parts += [f"covers non-generated positions {extra[:10]}"] if extra else []
    return f"the assistant mask {' and '.join(parts)} ({where})"


def _first(it: Iterator[TensorDictBase], what: str) -> TensorDictBase:
    try:
        return next(it)
    except StopIteration:
        raise _fail(f"{what}: the source stopped before yielding a batch") from None


def _first_batch(ctx: Context) -> tuple[Any, TensorDictBase]:
    """The policy and the first batch of a fresh source, which is then shut down."""
    policy, src = _source(ctx)
    try:
        return policy, _first(iter(src), "first batch")
    finally:
        src.shutdown()


def _versions(batch: TensorDictBase) -> set[int]:
    return {int(v) for v in batch.get(K("policy_version")).reshape(-1).tolist()}


def _prompt_part(toks: list[int], att: list[bool], asst: list[bool]) -> list[int]:
    """The real tokens before the first assistant token (left padding, if any, left out)."""
    first = asst.index(True) if True in asst else len(asst)
    return [t for t, a in zip(toks[:first], att[:first], strict=True) if a]


def _response_problem(toks: list[int], att: list[bool]) -> str | None:
    """How the real tokens after the prompt differ from what the scripted weights 0 generate."""
    real = [t for t, a in zip(toks, att, strict=True) if a]
    for p in PROMPTS:
        if real[: len(p)] == p:
            got, want = real[len(p) :], scripted_response(p, 0)
            if got == want:
                return None
            where = (
                f"the real tokens after prompt {p} are {got}, the policy generates {want}"
                f" (EOS {EOS}, which is also the pad token, included)"
            )
            if want[-1] == EOS and got == want[:-1]:
                return f"{where}: the generated EOS is masked out as padding"
            return where
    return None  # the prompt is not there: ROLL-002 reports it


@requirement("ROLL-001")
def batches_meet_layout(ctx: Context) -> None:
    # Scripted weights: two prompts end early with EOS, and the pad token is EOS.
    _policy, src = _scripted_source(ctx, total=3)
    try:
        for n, batch in enumerate(src):
            bad = LLM_LAYOUT_V1.violations(
                batch, require=("policy_version",), deep=True, ragged="ragged" in ctx.capabilities
            )
            rows = _rows_or_none(batch)
            # A shifted mask also breaks the layout (onto padding); say what it is first.
            for i, (toks, att, asst) in enumerate(rows or []):
                problem = _response_problem(toks, att) or _mask_problem(toks, att, asst)
                if problem is not None:
                    raise _fail(f"batch {n}, item {i}: {problem}")
            if bad:
                raise _fail(f"batch {n} breaks the LLM layout: " + "; ".join(str(v) for v in bad))
            for i, (toks, att, asst) in enumerate(rows if rows is not None else _rows(batch)):
                first = asst.index(True) if True in asst else None
                if first is None:
                    raise _fail(f"batch {n}, item {i}: no assistant token (nothing generated?)")
                if not all(asst[first : first + sum(asst)]):
                    raise _fail(
                        f"batch {n}, item {i}: the assistant mask {asst} is not one contiguous response"
                    )
                # The prompt may be left-padded (TRL's arrangement): real tokens, then the response.
                if not _prompt_part(toks, att, asst):
                    raise _fail(
                        f"batch {n}, item {i}: assistant tokens must follow a prompt; masks {att} / {asst}"
                    )
            if n == 1:
                break
    finally:
        src.shutdown()


PAD = 0  # tiny_causal_lm's pad_token_id


def _prompt_lists(long: int) -> Any:
    """ROLL-002's domain: batches of 1 to 6 prompts, each 1 to ``long`` token ids drawn over
    the whole vocabulary (the pad id 0 and EOS 2 among them), and a budget of 1 to 6 tokens."""
    from hypothesis import strategies as st

    token = st.one_of(st.sampled_from((PAD, EOS, 1, V - 1)), st.integers(0, V - 1))
    prompt = st.lists(token, min_size=1, max_size=long)
    return st.tuples(st.lists(prompt, min_size=1, max_size=6), st.integers(1, 6))


# Prompts the pad id or EOS start, end or fill; one token; longer than a short cut keeps.
PROMPT_EDGES: tuple[tuple[list[list[int]], int], ...] = (
    ([[PAD, 5, PAD], [EOS], [7, EOS, 8, PAD, PAD]], 3),
    ([[PAD], [PAD, PAD, 6]], 1),
    ([list(range(5, 29)), [9]], 2),
)


def _prompts_answered(batch: TensorDictBase, given: Sequence[list[int]]) -> str | None:
    """How the real tokens before each item's response differ from the prompts given."""
    seen = []
    for i, (toks, att, asst) in enumerate(_rows(batch)):
        prompt = _prompt_part(toks, att, asst)
        if prompt not in given:
            return (
                f"item {i}: the real tokens before the response are {prompt}, not one of the "
                f"prompts given {list(given)}"
            )
        seen.append(prompt)
    missing = [p for p in given if p not in seen]
    if missing:
        return f"the first batch answers none of the prompts {missing} (given {list(given)})"
    return None


@requirement("ROLL-002")
def prompt_preserved(ctx: Context) -> None:
    _policy, batch = _first_batch(ctx)
    problem = _prompts_answered(batch, PROMPTS)
    if problem is not None:
        raise _fail(problem)
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)

    def one(drawn: tuple[list[list[int]], int]) -> None:
        prompts, budget = drawn
        src = ctx.make(policy, [list(p) for p in prompts], 1, max_new_tokens=budget)
        try:
            batch = _first(iter(src), "first batch")
        finally:
            src.shutdown()
        problem = _prompts_answered(batch, prompts)
        if problem is not None:
            raise _fail(f"prompts {prompts}, max_new_tokens={budget}: {problem}")

    explore.for_all(ctx, _prompt_lists(24), one, examples=4, boundaries=PROMPT_EDGES)


def _stamped_weights(batch: TensorDictBase) -> list[tuple[int, int | None]]:
    """Per item: its stamp and which scripted weights generated it (None: cannot tell)."""
    out = []
    for it in _items(batch):
        toks = it.get(K("tokens")).tolist()
        gen = _generated(toks, it.get(K("attention_mask")).tolist())
        k = None if gen is None else _weights_of([toks[j] for j in gen])
        out.append((int(it.get(K("policy_version")).reshape(-1)[0]), k))
    return out


@requirement("ROLL-003")
def version_stamped(ctx: Context) -> None:
    policy, src = _scripted_source(ctx, total=None)
    seen: list[list[int]] = []
    after: list[tuple[int, list[tuple[int, int | None]]]] = []
    try:
        want = src.policy_version
        it = iter(src)
        # Three batches without an update: the stamp names the weights, which did not change.
        for n in range(3):
            batch = _first(it, f"batch {n}")
            seen.append(sorted(_versions(batch)))
            if seen[-1] != [int(want)]:
                raise _fail(
                    f"without update_policy_weights_, items of batch {n} carry policy_version "
                    f"{seen[-1]} (batches so far: {seen}); the source's policy_version was {want} "
                    "before the first"
                )
        now = src.policy_version
        if now != want:
            raise _fail(
                f"without update_policy_weights_, the source's policy_version went from {want} "
                f"to {now} over {len(seen)} batches"
            )
        try:
            src.update_policy_weights_(scripted_weights(policy, 1))
        except Exception:  # an update that fails is ROLL-004's to report
            return
        new = src.policy_version
        for n in range(3, 6):
            after.append((n, _stamped_weights(_first(it, f"batch {n} (after the update)"))))
    finally:
        src.shutdown()
    # The generated tokens name the weights (scripted 0 before the update, 1 after it).
    # A batch of the old weights is honest with the old stamp (it was in flight); with the
    # new one only if the new weights never showed up, which is ROLL-005's failure, not this.
    versions = {0: int(want), 1: int(new)}
    new_used = any(k == 1 for _n, items in after for _v, k in items)
    for n, items in after:
        for i, (v, k) in enumerate(items):
            if k not in versions or v == versions[k] or (k == 0 and not new_used):
                continue
            made = "before" if k == 0 else "after"
            raise _fail(
                f"batch {n}, item {i}: generated by the weights loaded {made} "
                f"update_policy_weights_ (their tokens say so), whose policy_version is "
                f"{versions[k]}, but stamped {v} (version {want} before the update, "
                f"{new} after)"
            )
    _explore_source(ctx, "stamps")


UNKNOWN = "not_a_parameter.weight"  # a name no policy has, sent beside a full state dict


class _SourceSpec:
    """The executable model of a rollout source (ROLL-003 to ROLL-005), on scripted weights.

    ``k`` names the weights the source generates with and ``version`` the source's
    ``policy_version`` for them. An update with weights ``j`` (a fresh dict, or the policy
    changed in place then ``update_policy_weights_(None)``) makes ``j`` the weights and the
    version rise; one with a name the policy lacks may raise (nothing changes) or ignore the
    name (like any update). A batch answers every prompt with what the weights ``k``
    generate, stamped ``version``; right after an update, a batch already generated with the
    weights before it may come once, stamped with their version (it was in flight).
    """

    def __init__(self, ctx: Context, focus: str) -> None:
        self.focus = focus
        self.policy, self.src = _scripted_source(ctx, total=None)
        self.it = iter(self.src)
        self.k = 0
        self.version = int(self.src.policy_version)
        self.in_flight: tuple[int, int] | None = None  # (weights, version) before an update
        # Weights loaded before the last update, while the newer ones have not shown up: a
        # batch of them stamped with the new version is ROLL-005's failure (old weights used).
        self.stale: set[int] = set()
        self.log: list[str] = []

    def batch(self) -> None:
        n = len(self.log)
        batch = _first(self.it, f"batch after {self._history()}")
        self.log.append("batch")
        flight, self.in_flight = self.in_flight, None
        now = int(self.src.policy_version)
        if self.focus == "stamps" and now != self.version:
            raise _fail(
                f"after {self._history(n)}, the source's policy_version is {now}; expected "
                f"{self.version} (it changes with update_policy_weights_ only)"
            )
        for i, it in enumerate(_items(batch)):
            toks = it.get(K("tokens")).tolist()
            att = it.get(K("attention_mask")).tolist()
            stamp = int(it.get(K("policy_version")).reshape(-1)[0])
            gen = _generated(toks, att)
            if gen is None:
                continue  # not one of the prompts: ROLL-002's failure
            real = [t for t, a in zip(toks, att, strict=True) if a]
            prompt = real[: len(real) - len(gen)]
            got = [toks[j] for j in gen]
            k = _weights_of(got)
            if self.focus == "weights" and got != scripted_response(prompt, self.k):
                raise _fail(
                    f"after {self._history(n)}, item {i} answers prompt {prompt} with {got}; "
                    f"the weights loaded last ({self.k}) generate "
                    f"{scripted_response(prompt, self.k)}"
                    + ("" if k is None else f" (its tokens are weights {k}'s)")
                )
            if self.focus != "stamps" or k is None:
                continue
            if k == self.k and stamp == self.version:
                self.stale = set()
                continue
            if flight is not None and (k, stamp) == flight:
                continue
            if k in self.stale and stamp == self.version:
                continue
            raise _fail(
                f"after {self._history(n)}, item {i} was generated by weights {k} (its tokens "
                f"say so) and stamped {stamp}; the weights loaded last are {self.k}, under "
                f"policy_version {self.version}"
            )

    def update(self, j: int, how: str) -> None:
        before = (self.k, self.version)
        weights = scripted_weights(self.policy, j)
        raised: Exception | None = None
        if how == "in_place":
            self.policy.load_state_dict(weights)
            self.src.update_policy_weights_(None)
        elif how == "unknown_name":
            weights[UNKNOWN] = torch.zeros(3)
            try:
                self.src.update_policy_weights_(weights)
            except Exception as e:  # refusing a name the policy lacks is allowed
                raised = e
        else:
            self.src.update_policy_weights_(weights)
        n = len(self.log)
        call = {
            "in_place": f"policy.load_state_dict(scripted_weights(policy, {j})); "
            "src.update_policy_weights_(None)",
            "unknown_name": f"src.update_policy_weights_(scripted_weights(policy, {j}) | "
            f"{{{UNKNOWN!r}: ...}})" + (" raised" if raised else ""),
            "fresh": f"src.update_policy_weights_(scripted_weights(policy, {j}))",
        }[how]
        self.log.append(call)
        now = int(self.src.policy_version)
        if raised is not None:
            if self.focus == "stamps" and now != self.version:
                raise _fail(
                    f"after {self._history(n)}, an update_policy_weights_ that raised "
                    f"({type(raised).__name__}) changed policy_version from {self.version} "
                    f"to {now}"
                )
            return
        # A version that does not rise is ROLL-004's failure: the stamps still name it.
        self.in_flight = before
        self.stale.add(self.k)
        self.k, self.version = j, now

    def _history(self, n: int | None = None) -> str:
        calls = self.log if n is None else self.log[:n]
        if not calls:
            return "no call"
        return (
            "[" + "; ".join(calls[-8:]) + "]" + (f" ({len(calls)} calls)" if len(calls) > 8 else "")
        )

    def close(self) -> None:
        self.src.shutdown()
        self.src.shutdown()


def _explore_source(ctx: Context, focus: str) -> None:
    """One fixed sequence (every kind of update, each followed by a batch), then the machine."""
    spec = _SourceSpec(ctx, focus)
    try:
        spec.batch()
        for j, how in ((1, "in_place"), (2, "unknown_name"), (2, "fresh")):
            spec.update(j, how)
            spec.batch()
    finally:
        spec.close()
    explore.run_machine(ctx, _machine(ctx, focus), examples=2, steps=6)


def _machine(ctx: Context, focus: str) -> type[Any]:
    """Random batch/update sequences on a new source each, against :class:`_SourceSpec`."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    class RolloutMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.spec = _SourceSpec(ctx, focus)

        @rule()
        def batch(self) -> None:
            self.spec.batch()

        @rule(j=st.integers(0, 5), how=st.sampled_from(("fresh", "in_place", "unknown_name")))
        def update(self, j: int, how: str) -> None:
            self.spec.update(j, how)

        def teardown(self) -> None:
            self.spec.close()

    RolloutMachine.__name__ = f"RolloutMachine_{focus}"
    return RolloutMachine


@requirement("ROLL-004")
def version_rises(ctx: Context) -> None:
    policy, src = _source(ctx, total=None)
    try:
        it = iter(src)
        before = _versions(_first(it, "first batch"))
        v0 = src.policy_version
        src.update_policy_weights_(policy.state_dict())
        if not src.policy_version > v0:
            raise _fail(
                f"policy_version went from {v0} to {src.policy_version} across update_policy_weights_"
            )
        after = _versions(_first(it, "batch after the update"))
        if not min(after) > max(before):
            raise _fail(
                f"stamps before the update {sorted(before)}, after {sorted(after)}: they must rise"
            )
    finally:
        src.shutdown()
    _updates_in_a_row(ctx)


def _updates_in_a_row(ctx: Context) -> None:
    """ROLL-004 over more of a source's life: an update before the first iteration, then two
    in a row (the second with None): each raises the version, and the next batch's stamps."""
    policy, src = _source(ctx, total=None)
    calls: list[str] = []
    try:
        stamps = {int(src.policy_version)}
        it: Iterator[TensorDictBase] | None = None
        for step in ("state_dict", "iter", "None", "state_dict", "batch"):
            if step == "iter":
                it = iter(src)
                calls.append("it = iter(src)")
                batch = _versions(_first(it, f"batch after {calls}"))
            elif step == "batch":
                assert it is not None
                batch = _versions(_first(it, f"batch after {calls}"))
            else:
                v = int(src.policy_version)
                arg = "None" if step == "None" else "policy.state_dict()"
                call = f"src.update_policy_weights_({arg})"
                src.update_policy_weights_(None if step == "None" else policy.state_dict())
                calls.append(call)
                if not int(src.policy_version) > v:
                    raise _fail(
                        f"policy_version went from {v} to {src.policy_version} across {call} "
                        f"(calls: {calls})"
                    )
                continue
            calls.append("next(it)")
            if not min(batch) > max(stamps):
                raise _fail(
                    f"after {calls}, the batch's stamps {sorted(batch)} are not greater than "
                    f"those before the updates {sorted(stamps)}"
                )
            stamps = batch | {int(src.policy_version)}
    finally:
        src.shutdown()


@requirement("ROLL-005")
def new_weights_used(ctx: Context) -> None:
    policy, src = _source(ctx, total=None)
    try:
        it = iter(src)
        old = _responses(_first(it, "first batch"))
        if all(all(t == FORCED for t in r) for r in old):
            raise _fail(f"suite error: the initial policy already emits only token {FORCED}")
        src.update_policy_weights_(forced_token_weights(policy, FORCED))
        batch = _first(it, "batch after the update")
    finally:
        src.shutdown()
    new = _responses(batch)
    wrong = [r for r in new if any(t != FORCED for t in r)]
    if wrong:
        done = f"after loading weights that always emit token {FORCED}"
        misplaced = _misplaced_mask(batch)
        if misplaced is not None:
            raise _fail(
                f"{done}, the generated tokens are all {FORCED} but {misplaced}, so the "
                f"masked responses {wrong[:4]} hold other tokens: the mask, not the weights"
            )
        raise _fail(f"{done}, responses {wrong} contain other tokens: old weights still in use")
    _explore_source(ctx, "weights")


def _misplaced_mask(batch: TensorDictBase) -> str | None:
    """When the new weights did generate only FORCED and the mask is off: where it is."""
    rows = _rows_or_none(batch)
    if not rows:
        return None
    first = None
    for i, (toks, att, asst) in enumerate(rows):
        gen = _generated(toks, att)
        if gen is None or not gen or any(toks[j] != FORCED for j in gen):
            return None
        problem = _mask_problem(toks, att, asst)
        if first is None and problem is not None:
            first = f"item {i}: {problem}"
    return first


@requirement("ROLL-006")
def declared_end(ctx: Context) -> None:
    _policy, src = _source(ctx, total=3)
    try:
        n = 0
        for _ in src:
            n += 1
            if n > 10:
                break
    finally:
        src.shutdown()
    if n != 3:
        raise _fail(
            f"declared total 3 batches, iteration yielded {n if n <= 10 else 'more than 10'}"
        )
    # Totals 0 and up, iterated again and again (updates between and inside), fresh sources.
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    life.budget_sequences(ctx, policy)
    explore.run_machine(ctx, life.budget_machine(ctx, policy), examples=2, steps=3)


@requirement("ROLL-007")
def shutdown(ctx: Context) -> None:
    _policy, src = _source(ctx, total=None)
    _first(iter(src), "first batch")
    src.shutdown()
    src.shutdown()  # idempotent: must not raise
    what, _err = life.answer(lambda: next(iter(src)))
    if what == "hung":
        raise _fail("iterating after shutdown() hangs (no answer within 20 s)")
    if what != "raised":
        said = {"yielded": "yielded a batch", "stopped": "stopped silently (StopIteration)"}
        raise _fail(f"iterating after shutdown() {said[what]}; expected a clear error")
    # Iterators taken before shutdown, at every point of their life; a spent total.
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    life.lifecycle_sequence(ctx, policy)
    explore.run_machine(ctx, life.lifecycle_machine(ctx, policy), examples=2, steps=5)


def _log_probs_problem(batch: TensorDictBase, models: dict[int, Any]) -> str | None:
    """How an item's ``sample_log_probs`` differ from those of the weights its stamp names.

    ``models`` maps a version to a model holding its weights; an item stamped with another
    version is ROLL-003's to report.
    """
    for i, it in enumerate(_items(batch)):
        model = models.get(int(it.get(K("policy_version")).reshape(-1)[0]))
        if model is None:
            continue
        toks = it.get(K("tokens"))[None]
        asst = it.get(K("assistant_mask"))[None]
        att = it.get(K("attention_mask"))[None].long()
        pos = (att.cumsum(-1) - 1).clamp(min=0)  # counted over real tokens: left padding too
        with torch.no_grad():
            want = token_log_probs(
                model(input_ids=toks, attention_mask=att, position_ids=pos).logits, toks
            )
        got = it.get(K("sample_log_probs"))[None]
        if not torch.allclose(got[asst], want[asst], atol=1e-4, rtol=0):
            return f"item {i}: sample_log_probs {got[asst].tolist()} differ from the policy's {want[asst].tolist()}"
    return None


@requirement("ROLL-008")
def behaviour_log_probs(ctx: Context) -> None:
    policy, batch = _first_batch(ctx)
    problem = _log_probs_problem(batch, {int(v): policy for v in _versions(batch)})
    if problem is not None:
        raise _fail(problem)
    # Prompts holding the pad id and EOS, then other weights: each batch's log-probs are
    # those of the weights its stamp names (a batch in flight at the update keeps the old).
    prompts = PROMPT_EDGES[0][0]
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    other = tiny_causal_lm(vocab_size=V, seed=ctx.seed + 1)
    src = ctx.make(policy, [list(p) for p in prompts], None, max_new_tokens=3)
    try:
        it = iter(src)
        v0, old = int(src.policy_version), copy.deepcopy(policy)
        problem = _log_probs_problem(_first(it, "first batch"), {v0: old})
        if problem is not None:
            raise _fail(f"prompts {prompts}: {problem}")
        src.update_policy_weights_({k: v.clone() for k, v in other.state_dict().items()})
        models = {v0: old, int(src.policy_version): other}
        problem = _log_probs_problem(_first(it, "batch after the update"), models)
        if problem is not None:
            raise _fail(
                f"prompts {prompts}, the batch after update_policy_weights_ with other "
                f"weights: {problem}"
            )
    finally:
        src.shutdown()


def _group_prompts() -> Any:
    """ROLL-009's domain: 2 to 4 prompts, most of them kin of one drawn prompt (the same, with
    the pad id or EOS before, after or inside it, a prefix of it, it extended), some drawn
    over the whole vocabulary."""
    from hypothesis import strategies as st

    def kin(base: list[int]) -> Any:
        filler = st.sampled_from((PAD, EOS))
        return st.one_of(
            st.just(base),
            filler.map(lambda f: [f, *base]),
            filler.map(lambda f: [*base, f]),
            st.tuples(filler, st.integers(0, len(base))).map(
                lambda x: [*base[: x[1]], x[0], *base[x[1] :]]
            ),
            st.integers(1, len(base)).map(lambda k: base[:k]),
            st.lists(st.integers(0, V - 1), min_size=1, max_size=3).map(lambda x: base + x),
            st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
        )

    base = st.lists(st.integers(3, V - 1), min_size=1, max_size=4)
    return base.flatmap(lambda b: st.lists(kin(b), min_size=2, max_size=4))


# Prompts that differ only by pad ids or EOS, are prefixes of each other, or are the same.
GROUP_EDGES: tuple[list[list[int]], ...] = (
    [[5, 6], [PAD, 5, 6], [5, 6, PAD], [5, EOS, 6]],
    [[5, 6, 7], [5, 6], [PAD], [5, 6]],
)


def _groups_problem(batch: TensorDictBase, given: Sequence[list[int]]) -> str | None:
    """How the batch's ``group_id`` differs from the prompts its items answer.

    A prompt is its token ids (the pad id and EOS included). Items of a prompt given once
    share one id; a prompt given more than once may be one group or one per time given.
    Items whose prompt is not among those given are ROLL-002's to report.
    """
    gids = [int(g) for g in batch.get(K("group_id")).reshape(-1).tolist()]
    prompts = [_prompt_part(toks, att, asst) for toks, att, asst in _rows(batch)]
    times = {tuple(p): sum(q == p for q in given) for p in given}
    known = [i for i, p in enumerate(prompts) if tuple(p) in times]
    for a, i in enumerate(known):
        for j in known[a + 1 :]:
            same_prompt, same_group = prompts[i] == prompts[j], gids[i] == gids[j]
            if not same_prompt and same_group:
                return (
                    f"items {i} and {j} answer different prompts {prompts[i]} / {prompts[j]} "
                    f"but share group id {gids[i]}"
                )
            if same_prompt and not same_group and times[tuple(prompts[i])] == 1:
                return (
                    f"items {i} and {j} answer the same prompt {prompts[i]} but carry group "
                    f"ids {gids[i]} / {gids[j]}"
                )
    for p, n in times.items():
        ids = {gids[i] for i in known if tuple(prompts[i]) == p}
        if len(ids) > n:
            return (
                f"the items answering prompt {list(p)} (given {n} times) carry {len(ids)} "
                f"group ids {sorted(ids)}: one group, or one per time given"
            )
    return None


@requirement("ROLL-009")
def groups_stamped(ctx: Context) -> None:
    _policy, batch = _first_batch(ctx)
    problem = _groups_problem(batch, PROMPTS)
    if problem is not None:
        raise _fail(problem)
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)

    def one(prompts: list[list[int]]) -> None:
        src = ctx.make(policy, [list(p) for p in prompts], 1, max_new_tokens=1)
        try:
            batch = _first(iter(src), "first batch")
        finally:
            src.shutdown()
        problem = _groups_problem(batch, prompts)
        if problem is not None:
            raise _fail(f"prompts {prompts}: {problem}")

    explore.for_all(ctx, _group_prompts(), one, examples=2, boundaries=GROUP_EDGES)


@requirement("ROLL-010")
def ragged_batches(ctx: Context) -> None:
    _policy, batch = _first_batch(ctx)
    for i, (_toks, att, _asst) in enumerate(_rows(batch)):
        if not all(att):
            raise _fail(f"item {i} of a ragged batch is padded: attention mask {att}")
    # Prompts the pad id starts, ends or fills, EOS inside one; two batches.
    prompts, budget = PROMPT_EDGES[0]
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    src = ctx.make(policy, [list(p) for p in prompts], 2, max_new_tokens=budget)
    try:
        for n, batch in enumerate(src):
            for i, (toks, att, _asst) in enumerate(_rows(batch)):
                if not all(att):
                    raise _fail(
                        f"prompts {prompts}, batch {n}, item {i} of a ragged batch is "
                        f"padded: tokens {toks}, attention mask {att}"
                    )
    finally:
        src.shutdown()
