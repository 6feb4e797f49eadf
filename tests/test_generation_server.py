"""The reference generation server's options beyond the default row."""

from __future__ import annotations

from functools import partial

from posttrain.conformance import Status, run
from posttrain.contracts import Implementation
from posttrain.reference_impls import ThreadGenerationServer

DRAIN = Implementation(
    "generation",
    partial(ThreadGenerationServer, on_shutdown="drain"),
    name="ThreadGenerationServer(on_shutdown='drain')",
    options={"on_shutdown": "drain"},
)


def test_drain_mode_serves_every_pending_request_at_shutdown() -> None:
    rep = run(DRAIN)
    rows = {r.id: r for r in rep.results}
    assert rows["GEN-008"].status is Status.PASS  # with 'drain' the check demands all served
    assert rep.ok


def test_a_server_that_fails_pending_requests_cannot_declare_drain() -> None:
    liar = Implementation(
        "generation",
        ThreadGenerationServer,  # on_shutdown="fail" by default
        name="ThreadGenerationServer declared drain",
        options={"on_shutdown": "drain"},
    )
    row = {r.id: r for r in run(liar).results}["GEN-008"]
    assert row.status is Status.FAIL
    assert "pending requests failed" in row.message
