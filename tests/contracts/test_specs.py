"""specs/ is generated from the catalogues: drift fails, and the machine spec is a real schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from posttrain.contracts import CONTRACTS
from posttrain.contracts.validation import LAYOUT_REQUIREMENTS
from posttrain.specgen import main, render_all
from tests.paths import ROOT

SPECS = ROOT / "specs"


def test_committed_specs_match_generation() -> None:
    files = render_all()
    committed = {p.name for p in SPECS.iterdir()}
    assert committed == set(files), "run `make specs` and commit specs/"
    stale = [n for n, text in files.items() if (SPECS / n).read_text() != text]
    assert not stale, f"specs drift in {stale}: run `make specs` and commit specs/"


def test_check_mode_detects_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 0
    assert main([str(tmp_path), "--check"]) == 0
    target = tmp_path / "buffer-v1.md"
    target.write_text(target.read_text().replace("BUF-009", "BUF-999"))
    (tmp_path / "stray.md").write_text("x")
    assert main([str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "buffer-v1.md differs" in err
    assert "stray.md is not generated" in err


@pytest.mark.parametrize("cid", sorted(CONTRACTS))
def test_every_requirement_is_in_both_specs(cid: str) -> None:
    c = CONTRACTS[cid]
    md = (SPECS / f"{cid}-v1.md").read_text()
    schema = json.loads((SPECS / f"{cid}-v1.schema.json").read_text())
    for r in c.requirements:
        assert f'<a id="{r.id}"></a>**{r.id}**' in md
        assert r.text in md
    assert [r["id"] for r in schema["x-requirements"]] == [r.id for r in c.requirements]


@pytest.mark.parametrize("cid", sorted(CONTRACTS))
def test_schema_validates_declarations(cid: str) -> None:
    c = CONTRACTS[cid]
    schema = json.loads((SPECS / f"{cid}-v1.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    good = {
        "contract": cid,
        "version": "1.0",
        "capabilities": [x.name for x in c.capabilities],
        "options": c.default_options(),
    }
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "capabilities": ["teleport"]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "version": "2.0"}, schema)


def test_layout_spec() -> None:
    md = (SPECS / "llm_layout-v1.md").read_text()
    for r in LAYOUT_REQUIREMENTS:
        assert f"**{r.id}**" in md
    assert "| tokens | `('tokens', 'full')` | int64 | [*B, T] | yes |" in md
    assert "`input_ids` (right-padded) with `input_lengths` (int32)" in md
    schema = json.loads((SPECS / "llm_layout-v1.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(schema["x-layout"], schema)
