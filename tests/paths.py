"""Where the tests find the repository's files, wherever in tests/ a test module lies."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root."""

DATA = ROOT / "tests" / "data"
"""Test vectors computed with the frameworks' own code (each file says where from)."""
