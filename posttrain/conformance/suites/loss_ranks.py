"""LOSS-017 across data-parallel ranks: micro-batches on real torch.distributed ranks add up.

The implementation under test is rebuilt in six processes forked from a forkserver that
imported torch and the implementation's module once (:func:`~posttrain._forkserver.context`;
the implementation from its ``module:attr`` import target, or else pickled, its factory
importable by name): four join a gloo process group of 4 ranks on 127.0.0.1 and two more one
of 2 ranks, at the same time. Each rank takes a shard of a drawn batch, splits it into
micro-batches, all-reduces the shard's ``GlobalCounts`` (the contract's way to the global
batch's counts), calls the loss on each micro-batch with them and accumulates the gradients;
the ranks then all-reduce the gradients and the ``loss_*`` terms by sum (the contract's rule;
DDP's mean is that divided by the world size). Each rank sets the environment torchrun sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and builds the loss once its group is up.
Rank 0 sends the sums back, and they are compared with the whole batch's, computed here in
one process. Each process serves one group, as each of a job's processes lives in one world:
a framework whose distributed state is per process (accelerate's ``PartialState``, which TRL's
loss gathers through) would otherwise still see 4 processes in the group of 2.
"""

from __future__ import annotations

import itertools
import math
import pickle
import queue as queue_mod
import random
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance._spawn import Spawned, context
from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_kit import (
    EMPTY_ROW,
    add_tol,
    live_batch,
    ragged_form,
    setup,
    split_name,
    trimmed,
    value_and_grads,
)

WORLDS = (4, 2)
"""The sizes of the gloo process groups the ranks form, each of processes of its own."""

_WORK_S = 60.0
"""How long the ranks' work may take once every rank runs, at the least: the deadline is
``max(_WORK_S, PER_STARTUP x the slowest rank's start)`` (:mod:`posttrain.conformance._spawn`),
so a loaded machine slows the check without failing it, and a rank that never answers fails it."""

_GLOO_TIMEOUT_S = 600.0
"""gloo's own timeout for a collective: a rank waiting on a lost one raises (and says so)."""

Shards = tuple[tuple[tuple[int, ...], ...], ...]
"""Per rank, its micro-batches, each a tuple of batch rows."""

Case = tuple[int, Shards, bool]
"""(index of the batch, the ranks' shards, micro-batches in ragged form)."""


def _boundaries(world: int, ragged: bool) -> list[Case]:
    """The 5-row batch of the in-process check (batch 0) with a rank holding only the row
    without an assistant token, the others uneven shards (one micro-batch per rank)."""
    shards: Shards
    if world == 2:
        shards = (((EMPTY_ROW,),), ((4, 0, 3, 1),))
    else:
        shards = (((3, 1),), ((4,),), ((0,),), ((EMPTY_ROW,),))
    cases: list[Case] = [(0, shards, False)]
    if ragged:
        cases.append((0, shards, True))
    return cases


def _draw_shards(rng: random.Random, rows: int, world: int) -> Shards:
    """An order of ``rows`` rows cut into ``world`` non-empty shards, each cut anywhere into
    the same number of micro-batches (every rank takes as many accumulation steps, as a
    data-parallel loop does: a loss may run a collective in each call, as TRL's metrics do)."""
    order = list(range(rows))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, rows), world - 1))
    parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
    steps = rng.randint(1, min(len(p) for p in parts))
    shards = []
    for part in parts:
        edges = [0, *sorted(rng.sample(range(1, len(part)), steps - 1)), len(part)]
        shards.append(tuple(tuple(part[x:y]) for x, y in itertools.pairwise(edges)))
    return tuple(shards)


def plan(ctx: Context) -> tuple[list[tuple[int, int]], dict[int, list[Case]]]:
    """The drawn batches (rows, seed) and, per world size, the cases the ranks run: the
    boundaries first, then 2 x ``--conformance-depth`` drawn ones, each on a batch of its own
    (4 to 8 rows), deterministic under ``--conformance-seed``.

    Example:
        >>> from posttrain.reference_impls import PG_LOSS_TOKEN_MEAN
        >>> batches, cases = plan(Context(PG_LOSS_TOKEN_MEAN, seed=0))
        >>> batches[0], sorted(cases), len(cases[4])
        ((5, 16), [2, 4], 3)
    """
    ragged = "ragged" in ctx.capabilities
    batches = [(5, 16)]
    cases: dict[int, list[Case]] = {}
    for world in WORLDS:
        rng = random.Random(ctx.seed * 1009 + world)
        cases[world] = _boundaries(world, ragged)
        for _ in range(2 * ctx.depth):
            rows = rng.randint(max(4, world), 8)
            batches.append((rows, 100 + len(batches)))
            as_ragged = ragged and rng.random() < 0.5
            cases[world].append((len(batches) - 1, _draw_shards(rng, rows, world), as_ragged))
    return batches, cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_sums(
    policy: Any, loss: Any, td: TensorDictBase, mine: tuple[tuple[int, ...], ...], as_ragged: bool
) -> tuple[dict[str, float], torch.Tensor, tuple[int, int]]:
    """One rank's part of a case: the global counts all-reduced from the shard's, then the
    micro-batches' ``loss_*`` terms and parameter gradients summed, all-reduced by sum."""
    import torch.distributed as dist

    from posttrain.contracts.loss import GlobalCounts

    forms = [ragged_form(c) if as_ragged else trimmed(c) for c in (td[list(p)] for p in mine)]
    local = GlobalCounts(0, 0)
    for f in forms:
        local = local + GlobalCounts.of(f)
    both = torch.tensor([local.tokens, local.sequences], dtype=torch.int64)
    dist.all_reduce(both)
    counts = GlobalCounts(int(both[0]), int(both[1]))
    terms: dict[str, float] = {}
    grad: torch.Tensor | None = None
    for f in forms:
        part, g = value_and_grads(policy, loss, f, counts)
        for k, v in part.items():
            terms[k] = terms.get(k, 0.0) + v
        grad = g if grad is None else grad + g
    assert grad is not None
    dist.all_reduce(grad)
    return terms, grad, (counts.tokens, counts.sequences)


def _rank_main(
    rank: int,
    world: int,
    source: tuple[str, Any],
    seed: int,
    depth: int,
    batches: list[TensorDictBase],
    cases: list[Case],
    port: int,
    out: Any,
) -> None:
    """A spawned rank of a group of ``world``: rebuilds the loss and runs every case.
    Rank 0 puts ``("result", world, case, per-rank terms, gradient, counts)`` on ``out``;
    any rank that raises puts ``("error", world, rank, traceback)``."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        impl = _rebuild(source)
        # What torchrun sets, so a framework that reads the launcher's environment (as
        # accelerate does) sees the ranks a user's launch gives it.
        for key, value in (
            ("RANK", rank),
            ("LOCAL_RANK", rank),
            ("WORLD_SIZE", world),
            ("LOCAL_WORLD_SIZE", world),
            ("MASTER_PORT", port),
        ):
            os.environ[key] = str(value)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        wait = timedelta(seconds=_GLOO_TIMEOUT_S)
        dist.init_process_group("gloo", init_method="env://", timeout=wait)
        try:
            # Built inside the group, as a data-parallel job builds its loss.
            policy, loss = setup(Context(impl, seed=seed, depth=depth))
            for i, (b, shards, as_ragged) in enumerate(cases):
                terms, grad, counts = _rank_sums(policy, loss, batches[b], shards[rank], as_ragged)
                per_rank: list[Any] = [None] * world
                dist.all_gather_object(per_rank, terms)
                if rank == 0:
                    # As an array, pickled by value: a tensor would travel as a shared-memory
                    # handle served by this process, which may have exited by the time the
                    # parent reads it (ConnectionResetError in the parent).
                    out.put(("result", world, i, per_rank, grad.numpy(), counts))
        finally:
            dist.destroy_process_group()
    except BaseException:
        out.put(("error", world, rank, traceback.format_exc()))


def _source(ctx: Context) -> tuple[str, Any]:
    """How a spawned rank rebuilds the implementation: its ``module:attr`` import target, or
    else the ``Implementation`` pickled (its factory importable by name); NotApplicable if
    neither."""
    from posttrain.conformance.runner import target_of

    target = target_of(ctx.impl)
    if target:
        return ("target", target)
    try:
        pickle.dumps(ctx.impl)  # spawn pickles the process arguments: fail here, not in a rank
    except Exception as e:
        raise NotApplicable(
            "micro-batches add up in one process; across data-parallel ranks not checked: a "
            "spawned rank cannot rebuild the implementation, which no module binds to a name "
            f"and whose factory {ctx.impl.factory!r} is not importable by name "
            f"({type(e).__name__}: {e})"
        ) from None
    return ("pickled", ctx.impl)


def _preload(ctx: Context, source: tuple[str, Any]) -> list[str]:
    """What the ranks' forkserver imports once: torch, the suite's policy, this module and the
    module that defines the implementation (its factory's, for a pickled one)."""
    factory = getattr(ctx.impl.factory, "func", ctx.impl.factory)
    own = source[1].split(":")[0] if source[0] == "target" else getattr(factory, "__module__", None)
    mods = ["torch", "torch.distributed", "transformers.models.llama.modeling_llama", __name__]
    return mods + ([own] if own and own != "__main__" else [])


def _rebuild(source: tuple[str, Any]) -> Any:
    how, what = source
    if how == "target":
        from posttrain.conformance.target import resolve

        return resolve(what, "loss")
    return what  # the Implementation itself, carried by multiprocessing's spawn


def _collect(ranks: Spawned, out: Any, expected: int) -> list[tuple[Any, ...]]:
    """The results rank 0 sends, until ``expected`` arrived, a rank failed or time ran out."""
    results: list[tuple[Any, ...]] = []
    try:
        budget = ranks.deadline_s(_WORK_S)
    except TimeoutError as e:
        raise _fail(f"the {len(ranks.procs)} spawned ranks did not start: {e}") from None
    deadline = time.monotonic() + budget
    while len(results) < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _fail(
                f"the {len(ranks.procs)} spawned ranks gave {len(results)} of {expected} results "
                f"within {budget:.0f} s of starting (20 times their slowest start, "
                f"{ranks.startup_s:.1f} s, at least {_WORK_S:g} s): a rank hangs"
            )
        try:
            msg = out.get(timeout=min(left, 1.0))
        except queue_mod.Empty:
            dead = [p for p in ranks.procs if p.exitcode not in (None, 0)]
            if dead:
                raise _fail(
                    f"a spawned rank exited with code {dead[0].exitcode} before answering "
                    "(the loss or its framework ended the process)"
                ) from None
            continue
        if msg[0] == "error":
            raise _fail(
                f"rank {msg[2]} of a gloo process group of {msg[1]} raised:\n{msg[3].rstrip()}"
            )
        results.append(msg)
    return results


def _run_ranks(
    ctx: Context,
    source: tuple[str, Any],
    batches: list[TensorDictBase],
    cases: dict[int, list[Case]],
) -> list[tuple[Any, ...]]:
    preload = _preload(ctx, source)
    out = context(preload).Queue()
    args = []
    for world in WORLDS:
        port = _free_port()
        args += [
            (r, world, source, ctx.seed, ctx.depth, batches, cases[world], port, out)
            for r in range(world)
        ]
    ranks = Spawned(_rank_main, args, preload=preload)
    try:
        return _collect(ranks, out, sum(len(c) for c in cases.values()))
    finally:
        for p in ranks.procs:
            p.join(timeout=5.0)
        ranks.terminate()


def _describe(world: int, td: TensorDictBase, case: Case, counts: tuple[int, int]) -> str:
    _, shards, as_ragged = case
    ranks = "; ".join(f"rank {r}: {split_name(s)}" for r, s in enumerate(shards))
    return (
        f"{world} gloo ranks (spawned processes) on a batch of {td.shape[0]} rows (row "
        f"{EMPTY_ROW} without assistant tokens; off policy, reference log-probs off the "
        f"policy's), each rank's shard split into {'ragged ' if as_ragged else ''}micro-batches "
        f"({ranks}), each called with the global counts all-reduced over the ranks "
        f"({counts[0]} tokens, {counts[1]} sequences), gradients and terms all-reduced by sum"
    )


def _compare(
    ctx: Context,
    what: str,
    full: dict[str, float],
    g_full: torch.Tensor,
    per_rank: list[dict[str, float]],
    grad: torch.Tensor,
) -> None:
    add = add_tol(ctx)
    names = set(full).union(*per_rank)
    for name in sorted(names, key=lambda n: (n != "loss_objective", n)):
        got = sum(t.get(name, 0.0) for t in per_rank)
        want = full.get(name, 0.0)
        scale = max([abs(want)] + [abs(t.get(name, 0.0)) for t in per_rank])
        if not abs(got - want) <= add * max(scale, 1e-6):  # NaN fails too
            shown = ", ".join(f"{t.get(name, 0.0):.6g}" for t in per_rank)
            raise _fail(
                f"{what}: the ranks' {name} ({shown}) sum to {got:.6g}, the whole batch's in "
                f"one process is {want:.6g}"
            )
    err = float((grad - g_full).abs().max())
    if not err <= add * max(float(g_full.abs().max()), 1e-12) or math.isnan(err):
        raise _fail(
            f"{what}: the all-reduced parameter gradient differs from the whole batch's in "
            f"one process by up to {err:.3g} (largest entry {float(g_full.abs().max()):.3g})"
        )


def ranks_add_up(ctx: Context) -> None:
    """LOSS-017 across 2 and 4 gloo ranks, at every depth since loss 1.9 (six ranks fork from a
    forkserver that imported torch, the suite's policy and the implementation's module once
    per process: about 6 s the first time, then 1 to 3 s per implementation on 2 cores, where
    fresh interpreters cost about 3.5 s of CPU each); NotApplicable where the implementation
    cannot be rebuilt in a spawned process (no import target, and its factory not importable
    by name).

    Example:
        >>> from posttrain.reference_impls import PG_LOSS_TOKEN_MEAN
        >>> ranks_add_up(Context(PG_LOSS_TOKEN_MEAN, seed=0))  # doctest: +SKIP
    """
    source = _source(ctx)
    policy, loss = setup(ctx)
    shapes, cases = plan(ctx)
    batches = [live_batch(policy, ctx, rows=rows, seed=seed) for rows, seed in shapes]
    wholes = [value_and_grads(policy, loss, td, None) for td in batches]
    for _, world, i, per_rank, array, counts in _run_ranks(ctx, source, batches, cases):
        grad = torch.from_numpy(array)
        case = cases[world][i]
        td = batches[case[0]]
        what = f"aggregation {ctx.options['aggregation']!r}, {_describe(world, td, case, counts)}"
        full, g_full = wholes[case[0]]
        _compare(ctx, what, full, g_full, per_rank, grad)
