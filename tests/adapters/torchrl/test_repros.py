"""The TorchRL repro scripts and the deviation records point at each other, one to one.

Each repro runs in the test of its contract's TorchRL rows (tests/adapters/torchrl/,
tests/adapters/ray/test_ray.py), which checks that it still shows its deviation.
"""

from __future__ import annotations

from posttrain.adapters.torchrl import deviations as dev

ALL = (
    *dev.DEVIATIONS,
    *dev.LOSS_DEVIATIONS,
    *dev.ROLLOUT_DEVIATIONS,
    *dev.WEIGHT_SYNC_DEVIATIONS,
    *dev.GENERATION_DEVIATIONS,
    *dev.RAY_DEVIATIONS,
    *dev.LOGGER_DEVIATIONS,
)


def test_every_deviation_has_its_own_repro_script() -> None:
    missing = [d.repro_name for d in ALL if not d.path.is_file()]
    names = [d.repro_name for d in ALL]
    assert missing == [], f"expected a script in {dev.REPRO_DIR} per deviation, missing: {missing}"
    assert len(set(names)) == len(names), "expected each script under one deviation"


def test_every_repro_script_belongs_to_a_deviation() -> None:
    scripts = {p.stem for p in dev.REPRO_DIR.glob("[a-z]*.py")} - {"conftest"}
    orphans = sorted(scripts - {d.repro_name for d in ALL})
    assert orphans == [], f"expected every repro under a deviation, found orphans: {orphans}"


def test_each_repro_names_its_requirements_first() -> None:
    # The script's first line is what a maintainer sees first in the pasted code.
    bad = [d.repro_name for d in ALL if not d.source().startswith(f'"""{d.requirements[0]}')]
    assert bad == []
