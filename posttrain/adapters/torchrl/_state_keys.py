"""Stored columns' names in a TorchRL buffer's state, kept apart when they hold '.'.

TorchRL's storages save their columns through ``TensorDict.state_dict``, which joins nested
names with '.': ``'a.b'`` and ``('a', 'b')`` become one entry, and a lone ``'a.b'`` loads back
as ``('a', 'b')``. ``ValidatedReplayBuffer`` writes each name percent-encoded instead ('%' as
``%25``, '.' as ``%2E``), so '.' separates nested names only, and decodes them once TorchRL has
loaded the state.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from tensordict import TensorDictBase

_CODE = re.compile(r"%(25|2E)")


def encoded(name: str) -> str:
    """``name`` with '%' and '.' percent-encoded.

    Example:
        >>> encoded("a.b"), encoded("50%.x")
        ('a%2Eb', '50%25%2Ex')
    """
    return name.replace("%", "%25").replace(".", "%2E")


def decoded(name: str) -> str:
    """:func:`encoded`'s inverse.

    Example:
        >>> decoded("50%25%2Ex"), decoded("a%252E")
        ('50%.x', 'a%2E')
    """
    return _CODE.sub(lambda m: "%" if m.group(1) == "25" else ".", name)


def flat_name(key: str | tuple[str, ...]) -> str:
    """A column's key as one state-dict name: its encoded names joined with '.'.

    Example:
        >>> flat_name(("a", "b")), flat_name("a.b")
        ('a.b', 'a%2Eb')
    """
    return ".".join(encoded(p) for p in ((key,) if isinstance(key, str) else key))


def flat_columns(td: TensorDictBase) -> OrderedDict[str, Any]:
    """``td.state_dict()`` with every name encoded: its leaves by :func:`flat_name`, and in
    ``_metadata`` each (sub-)TensorDict's batch size and device by its encoded prefix.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a.b": torch.zeros(2), ("a", "b"): torch.ones(2)}, [2])
        >>> sorted(flat_columns(td)), sorted(flat_columns(td)._metadata)
        (['a%2Eb', 'a.b'], ['', 'a'])
    """
    out: OrderedDict[str, Any] = OrderedDict()
    meta: OrderedDict[str, Any] = OrderedDict()
    meta[""] = {"batch_size": td.batch_size, "device": td.device}
    for key, value in td.items(include_nested=True, leaves_only=False):
        if isinstance(value, TensorDictBase):
            meta[flat_name(key)] = {"batch_size": value.batch_size, "device": value.device}
        else:
            out[flat_name(key)] = value
    out._metadata = meta  # type: ignore[attr-defined]
    return out


def decode_columns(td: TensorDictBase) -> TensorDictBase:
    """``td`` with its leaves under their decoded names (``td`` itself if none is encoded).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a%2Eb": torch.zeros(2), "a": {"b": torch.ones(2)}}, [2])
        >>> sorted(map(str, decode_columns(td).keys(True, True)))
        ["('a', 'b')", 'a.b']
    """
    leaves = list(td.items(include_nested=True, leaves_only=True))
    names = [(k,) if isinstance(k, str) else tuple(k) for k, _ in leaves]
    plain = [tuple(decoded(p) for p in n) for n in names]
    if plain == names:
        return td
    out = td.empty()
    for key, (_, value) in zip(plain, leaves, strict=True):
        out.set(key if len(key) > 1 else key[0], value)
    return out
