"""BUF-009 to BUF-012's bad extends: batches that get one stored key wrong, and the check that
each is refused naming the key with the buffer left exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.suites._buffer_run import CAP, Run, T, short_err
from posttrain.conformance.suites._compare import leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.keys import key_str
from posttrain.testing import llm_batch

BadCase = tuple[Callable[[TensorDictBase], TensorDictBase], str, tuple[str, ...]]
"""A bad batch for ``rejects``: (make it from a good one, what it gets wrong, names the error
must contain)."""


def rejects(ctx: Context, cases: list[BadCase], fill: int = 6, n: int = 3) -> None:
    """Each bad extend must raise naming the key, and leave everything exactly as before.

    The cases go to one buffer holding ``fill`` writes, each a batch of ``n`` items, and an
    untouched twin says where the next write must land. A case that was accepted ends the run:
    what it did to len, contents and the next write is reported, including exceptions the
    kit's own later calls then raise.
    """
    r, twin = Run(ctx), Run(ctx)
    for run in (r, twin):
        run.write(fill)
    before = len(r.rb)
    problems: list[str] = []
    for make_bad, what, names in cases:
        bad = make_bad(r.batch(n))
        accepted = False
        try:
            r.rb.extend(bad)
        except Exception as e:  # any exception type; the message must name the key
            if not all(name in str(e) for name in names):
                named = " and ".join(repr(name) for name in names)
                problems.append(
                    f"extend with {what}: raised {type(e).__name__} without naming {named}: "
                    f"{str(e)[:200]}"
                )
        else:
            accepted = True
            problems.append(f"extend with {what}: was accepted")
        if len(r.rb) != before:
            problems.append(f"len went from {before} to {len(r.rb)}")
            break  # the buffer changed: later cases would only report that again
        if accepted:
            break
    try:
        r.expect_stored("contents")
    except ConformanceError as e:
        problems.append(str(e))
    except Exception as e:  # the kit's own sample, after a bad batch went in: still a FAIL
        problems.append(f"then sample raised {short_err(e)}")
    twin.next_uid = r.next_uid
    nxt = r.batch(4)
    try:
        a = r.rb.extend(nxt).tolist()
    except Exception as e:
        problems.append(f"then the next (good) extend raised {short_err(e)}")
    else:
        b = twin.rb.extend(nxt).tolist()
        if a != b:
            problems.append(f"the next extend wrote at {a}; an untouched buffer writes at {b}")
    if problems:
        if not problems[0].startswith("extend with"):  # every bad extend raised, naming its key
            head = (
                f"extend with {cases[0][1]}"
                if len(cases) == 1
                else f"{len(cases)} extends, each with one stored key missing, all raised"
            )
            raise _fail(f"{head}: " + "; ".join(problems))
        raise _fail("; ".join(problems))


def naming(key: tuple[str, ...], stored: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The parts of ``key`` an error must contain to name it among ``stored``: its shortest
    suffix no other stored key ends with (``('log_probs', 'full')``: both parts, since
    ``('tokens', 'full')`` ends with ``'full'`` too)."""
    for m in range(1, len(key) + 1):
        if sum(1 for k in stored if k[-m:] == key[-m:]) == 1:
            return key[-m:]
    return key


ITEM = leaves(llm_batch(1, T))
"""One stored item's leaves: the schema every bad extend starts from."""
STORED = list(ITEM)


REAL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fmt: skip
Bad = tuple[tuple[str, ...], Any, int, int]
"""A generated bad extend: (key, what is wrong with it, items in the batch, items written before)."""


def bad_extends(what: Any) -> Any:
    """(key, ``what``, batch size 1..CAP+2, fill 0..2*CAP) for every stored key."""
    from hypothesis import strategies as st

    return st.tuples(
        st.sampled_from(STORED), what, st.integers(1, CAP + 2), st.integers(1, 2 * CAP)
    )


def retyped(key: tuple[str, ...], dtype: torch.dtype) -> Callable[[TensorDictBase], TensorDictBase]:
    def bad(td: TensorDictBase) -> TensorDictBase:
        return td.set(key, td.get(key).to(dtype), inplace=False)

    return bad


RESHAPES = ("longer", "shorter", "same count", "extra dim")
"""How BUF-012 changes one key's trailing shape: its last dim one longer or one shorter (a key
of shape [N] becomes [N, 2] or [N, 1]), its elements regrouped ([N, T] as [N, T/2, 2] or
[N, 1, T]: the element count kept) or a trailing dim of 1 added."""


def reshaped(
    key: tuple[str, ...], how: str
) -> tuple[Callable[[TensorDictBase], TensorDictBase], str]:
    def new(v: torch.Tensor) -> torch.Tensor:
        rest = v.shape[1:]
        if how == "longer":
            return torch.cat([v, v[..., :1]], dim=-1) if rest else v[:, None].expand(-1, 2).clone()
        if how == "shorter":
            return v[..., :-1].clone() if rest and rest[-1] > 1 else v[:, None].clone()
        if how == "same count":
            if rest and rest[-1] % 2 == 0:
                return v.reshape(v.shape[0], *rest[:-1], rest[-1] // 2, 2).clone()
            return v.reshape(v.shape[0], 1, *rest).clone()
        return v[..., None].clone()

    def bad(td: TensorDictBase) -> TensorDictBase:
        return td.set(key, new(td.get(key)), inplace=False)

    shape = list(ITEM[key].shape[1:])
    found = list(new(ITEM[key]).shape[1:])
    return bad, f"key {key_str(key)} of item shape {found} instead of {shape}"
