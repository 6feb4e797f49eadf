"""Catalogue integrity, declarations, and the public surface's docstrings."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

import posttrain.conformance
import posttrain.contracts
import posttrain.reference_impls
from posttrain.contracts import (
    CONTRACTS,
    Contract,
    DeclarationError,
    Implementation,
    ReplayBufferV1,
    Requirement,
    get_contract,
)
from posttrain.contracts.buffer import BUFFER
from posttrain.contracts.contract import Capability, Option
from posttrain.contracts.loss import LOSS
from posttrain.contracts.requirements import Level
from posttrain.contracts.validation import LAYOUT_REQUIREMENTS

PREFIX = {
    "buffer": "BUF",
    "rollout": "ROLL",
    "weight_sync": "WS",
    "loss": "LOSS",
    "metrics": "MET",
    "generation": "GEN",
    "nll_loss": "NLL",
    "dpo_loss": "DPO",
}


@pytest.mark.parametrize("cid", sorted(CONTRACTS))
def test_catalogue_integrity(cid: str) -> None:
    c = CONTRACTS[cid]
    assert c.major == 1

    # Minor versions: every requirement says since when and which versions tightened its
    # check, never after the contract; a version past 1.0 is explained by one of them.
    def v(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    assert all(v(r.since) <= v(c.version) for r in c.requirements)
    assert all(v(t) <= v(c.version) for r in c.requirements for t in r.tightened)
    changed = {r.since for r in c.requirements} | {t for r in c.requirements for t in r.tightened}
    assert c.version == max(changed, key=v)
    assert c.requirements
    ids = [r.id for r in c.requirements]
    assert all(i.startswith(PREFIX[cid] + "-") for i in ids)
    assert ids == sorted(ids), "ids are listed in order"
    assert any(r.level is Level.MUST for r in c.requirements)
    # A capability gates a requirement, or changes what one checks and the text says how
    # (weight_sync's applies_on_send, named in WS-002).
    for cap in c.capabilities:
        assert any(
            r.capability == cap.name or f"capability `{cap.name}`" in r.text for r in c.requirements
        ), f"capability {cap.name} has no requirement"


def test_layout_requirements() -> None:
    assert [r.id for r in LAYOUT_REQUIREMENTS] == [f"LAY-00{i}" for i in range(1, 8)]


def test_requirement_model_rejects_bad_ids_and_texts() -> None:
    with pytest.raises(ValidationError, match="must look like 'BUF-001'"):
        Requirement(id="buf-1", level=Level.MUST, title="t", text="x MUST y")
    with pytest.raises(ValidationError, match="must contain MUST or SHOULD"):
        Requirement(id="BUF-001", level=Level.MUST, title="t", text="x may y")


def test_contract_model_rejects_inconsistent_catalogues() -> None:
    r1 = Requirement(id="X-001", level=Level.MUST, title="a", text="a MUST b")
    r2 = Requirement(id="X-002", level=Level.MUST, title="b", text="b MUST c", capability="nope")
    r3 = Requirement(
        id="X-003", level=Level.MUST, title="c", text="c MUST d", depends_on=("X-004",)
    )

    def make(*reqs: Requirement) -> Contract:
        return Contract(
            id="x",
            title="x",
            purpose="x",
            protocol=ReplayBufferV1,
            factory="f()",
            requirements=reqs,
        )

    with pytest.raises(ValidationError, match="duplicate requirement ids"):
        make(r1, r1)
    with pytest.raises(ValidationError, match="unknown capability 'nope'"):
        make(r1, r2)
    with pytest.raises(ValidationError, match="must be an earlier requirement"):
        make(r1, r3)
    with pytest.raises(ValidationError, match="default 'b' not in"):
        Option(name="o", values=("a",), default="b", text="t")
    assert Capability(name="c", text="t").name == "c"


def test_declarations() -> None:
    assert BUFFER.resolve_declaration(["checkpoint"], {"sampling": "without_replacement"}) == {
        "eviction": "fifo",
        "sampling": "without_replacement",
    }
    with pytest.raises(DeclarationError) as info:
        LOSS.resolve_declaration(["teleport"], {"aggregation": "token_meen", "clip": "0.2"})
    msg = str(info.value)
    assert "unknown capability 'teleport'" in msg
    assert (
        "option 'aggregation': expected one of ['token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm'], found 'token_meen'"
        in msg
    )
    assert "unknown option 'clip'; declared options are: aggregation" in msg
    applicable = {r.id for r in BUFFER.applicable(["priority"])}
    assert "BUF-017" in applicable
    assert "BUF-016" not in applicable  # sampling=without_replacement only
    assert "BUF-018" not in applicable  # checkpoint not declared


def test_implementation_validates_its_declaration() -> None:
    with pytest.raises(DeclarationError, match="unknown capability 'fast'"):
        Implementation("buffer", lambda c: None, capabilities={"fast"})
    with pytest.raises(KeyError, match="unknown contract 'bufer'; known contracts: buffer"):
        Implementation("bufer", lambda c: None)
    impl = Implementation("buffer", posttrain.reference_impls.make_ring_buffer)
    assert impl.name == "make_ring_buffer"
    with pytest.raises(KeyError, match="has no requirement 'BUF-999'"):
        get_contract("buffer").requirement("BUF-999")


@pytest.mark.parametrize(
    "module", [posttrain.contracts, posttrain.conformance, posttrain.reference_impls]
)
def test_public_names_have_docstrings_with_examples(module: object) -> None:
    missing = []
    for name in module.__all__:  # type: ignore[attr-defined]
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj) or ""
        if ">>>" not in doc:
            missing.append(name)
    assert not missing, f"public names without a docstring example: {missing}"
