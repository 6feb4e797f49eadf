"""LOSS-017 across data-parallel ranks (posttrain/conformance/suites/loss_ranks.py): how a
spawned rank rebuilds the implementation, and the cases the ranks run. The check itself runs
in the selftest (the reference passes, the RankLocalCounts mutant fails LOSS-017)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.suites import loss_ranks
from posttrain.conformance.suites.loss_kit import EMPTY_ROW
from posttrain.contracts import Implementation
from posttrain.reference_impls import PG_LOSS_TOKEN_MEAN, PolicyGradientLoss


def test_a_bound_implementation_travels_by_its_import_target() -> None:
    assert loss_ranks._source(Context(PG_LOSS_TOKEN_MEAN)) == (
        "target",
        "posttrain.reference_impls:PG_LOSS_TOKEN_MEAN",
    )


def test_an_unbound_one_travels_pickled_when_its_factory_is_importable() -> None:
    impl = Implementation("loss", partial(PolicyGradientLoss, aggregation="token_mean"))
    how, what = loss_ranks._source(Context(impl))
    assert how == "pickled"
    assert loss_ranks._rebuild((how, what)).factory.func is PolicyGradientLoss


def test_one_no_rank_can_rebuild_is_not_applicable_never_passed() -> None:
    def local(policy: Any, **kw: Any) -> Any:
        return PolicyGradientLoss(policy, **kw)

    impl = Implementation("loss", local, capabilities={"global_counts"})
    with pytest.raises(NotApplicable, match="not importable by name"):
        loss_ranks._source(Context(impl))


def test_each_group_runs_the_boundaries_then_drawn_cases_deterministically() -> None:
    ctx = Context(PG_LOSS_TOKEN_MEAN, seed=3)
    batches, cases = loss_ranks.plan(ctx)
    assert (batches, cases) == loss_ranks.plan(Context(PG_LOSS_TOKEN_MEAN, seed=3))
    for world in loss_ranks.WORLDS:
        for b, shards, _ in cases[world]:
            rows = [r for shard in shards for part in shard for r in part]
            assert len(shards) == world
            assert all(shards)
            assert sorted(rows) == list(range(batches[b][0]))
            assert len({len(shard) for shard in shards}) == 1  # as many steps on every rank
    # A rank holding only the row without an assistant token comes first in both groups.
    assert all(((EMPTY_ROW,),) in cases[w][0][1] for w in loss_ranks.WORLDS)


def test_the_reference_adds_up_across_ranks_from_the_depth_the_ranks_run_at() -> None:
    from posttrain.conformance.outcome import Status
    from tests.outcomes import run_for

    rows = {r.id: r for r in run_for(PG_LOSS_TOKEN_MEAN, "LOSS-017", depth=2).results}
    assert rows["LOSS-017"].status is Status.PASS, rows["LOSS-017"].message
