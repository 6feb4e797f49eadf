"""Which class the NeMo-RL adapters use: nemo_rl's own where it imports, else the mirror's.

nemo_rl is not installed here, so the mirror path runs as is; the preference for an
importable nemo_rl is shown with a FAKE nemo_rl package written to a temporary directory and
put on sys.path for one test (it defines only what the selection looks up).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posttrain.adapters.nemo_rl.loss import nll_loss
from posttrain.adapters.nemo_rl.mirror.batched_data_dict import BatchedDataDict
from posttrain.adapters.nemo_rl.payload import decode_payload, encode_payload
from posttrain.adapters.nemo_rl.train_data import batched_data_dict
from posttrain.adapters.nemo_rl.upstream import MIRRORED, from_nemo_rl, nemo_rl_or_mirror


def test_without_nemo_rl_the_mirror_is_used() -> None:
    if "nemo_rl" in sys.modules or from_nemo_rl("BatchedDataDict") is not None:
        pytest.skip("nemo_rl imports here: the mirror path is not taken")
    assert nemo_rl_or_mirror("BatchedDataDict") is BatchedDataDict
    back = decode_payload(encode_payload({"batch": BatchedDataDict({"x": [1]})}))
    assert type(back["batch"]) is BatchedDataDict
    assert type(batched_data_dict({"x": [1]})) is dict  # train data stays a plain dict


def test_an_unknown_name_is_refused_by_name() -> None:
    with pytest.raises(KeyError, match=r"expected one of \['BatchedDataDict'\], found 'LossType'"):
        nemo_rl_or_mirror("LossType")  # no mirror: the loss wrappers carry the string value
    with pytest.raises(KeyError, match=r"expected one of \[.*'LossType'.*\], found 'Nope'"):
        from_nemo_rl("Nope")
    assert nll_loss().loss_type == "token_level"  # without nemo_rl: the string value


def _fake_nemo_rl(root: Path) -> None:
    """A FAKE ``nemo_rl``: NeMo-RL's module paths of BatchedDataDict and the loss enums only."""
    pkg = root / "nemo_rl" / "distributed"
    loss = root / "nemo_rl" / "algorithms" / "loss"
    pkg.mkdir(parents=True)
    loss.mkdir(parents=True)
    (root / "nemo_rl" / "__init__.py").write_text('"""FAKE nemo_rl for one test."""\n')
    for d in (pkg, loss.parent, loss):
        (d / "__init__.py").write_text("")
    (pkg / "batched_data_dict.py").write_text(
        "from collections import UserDict\n\n\n"
        "class BatchedDataDict(UserDict):\n"
        '    """FAKE: stands where NeMo-RL defines its class."""\n'
    )
    (loss / "interfaces.py").write_text(
        "import enum\n\n\n"
        "class LossType(enum.Enum):\n"
        '    TOKEN_LEVEL = "token_level"\n'
        '    SEQUENCE_LEVEL = "sequence_level"\n\n\n'
        "class LossInputType(enum.Enum):\n"
        '    LOGPROB = "logprob"\n'
    )


def test_an_importable_nemo_rl_is_preferred(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_nemo_rl(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        chosen = nemo_rl_or_mirror("BatchedDataDict")
        assert chosen.__module__ == MIRRORED["BatchedDataDict"][0]
        assert chosen is not BatchedDataDict
        assert from_nemo_rl("BatchedDataDict") is chosen
        back = decode_payload(encode_payload({"batch": BatchedDataDict({"x": [1]})}))
        assert type(back["batch"]) is chosen
        assert type(batched_data_dict({"x": [1]})) is chosen
        loss_type = from_nemo_rl("LossType")
        assert loss_type is not None
        assert nll_loss().loss_type is loss_type.TOKEN_LEVEL
    finally:
        for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
            del sys.modules[name]
