"""Every script in examples/ runs (in process, CPU, tiny models, nothing downloaded)."""

from __future__ import annotations

import math
import runpy
import warnings
from pathlib import Path

import pytest

from tests.paths import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = runpy.run_path(str(path))["main"]()
    if isinstance(result, list):
        assert result
        assert all(math.isfinite(x) for x in result)
    elif isinstance(result, int):
        assert result > 0
    else:
        assert len(result) > 0
