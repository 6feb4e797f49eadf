"""NeMo-RL trajectories as bytes without pickle: how the replay buffer stores a pushed group.

What NeMo-RL's trajectory collector pushes (``{"batch": <BatchedDataDict>, "rollout_metrics",
"timestamp", ...}``) becomes one uint8 tensor: a JSON tree plus each tensor's raw bytes,
dtypes and shapes kept bit-exactly. Decoding builds ``BatchedDataDict``s with ``nemo_rl``'s
class where it imports, else the mirror's (:func:`~posttrain.adapters.nemo_rl.upstream.nemo_rl_or_mirror`).
Nothing read back runs code: a malformed payload raises :class:`PayloadError`.
"""

from __future__ import annotations

import json
import math
from collections import UserDict
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.adapters.nemo_rl.upstream import nemo_rl_or_mirror
from posttrain.errors import PosttrainError

PAYLOAD_FORMAT = "posttrain-nemo-trajectory/1"
"""Written into every payload and checkpoint; one of another format is refused by name."""

_DTYPES = {
    str(d): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}  # fmt: skip


class PayloadError(PosttrainError, ValueError):
    """A trajectory this codec cannot encode, or bytes that are not one of its payloads.

    Example:
        >>> encode_payload({"f": object()})
        Traceback (most recent call last):
        ...
        posttrain.adapters.nemo_rl.payload.PayloadError: trajectory['f']: cannot encode ...
    """


def encode_payload(obj: Any) -> torch.Tensor:
    """``obj`` (dicts, lists, tuples, BatchedDataDicts, tensors, scalars, strings) as uint8 bytes.

    No pickle: a JSON tree (dict keys may be str, int, float, bool or None) and each tensor's
    raw bytes; tensors come back on CPU, detached, with their dtype and shape. Anything else
    raises :class:`PayloadError` naming where it is.

    Example:
        >>> t = {"batch": {"ids": torch.tensor([[1, 2]]), "msg": ["hi"]}, "timestamp": 1.5}
        >>> back = decode_payload(encode_payload(t))
        >>> back["batch"]["ids"].tolist(), back["batch"]["msg"], back["timestamp"]
        ([[1, 2]], ['hi'], 1.5)
    """
    tensors: list[torch.Tensor] = []

    def tree(v: Any, where: str) -> Any:
        if v is None or isinstance(v, bool | int | str):
            return v
        if isinstance(v, float):
            return {"$f": repr(v)} if not math.isfinite(v) else v
        if isinstance(v, torch.Tensor):
            if v.is_sparse or str(v.dtype) not in _DTYPES:
                raise PayloadError(f"{where}: cannot encode a {v.dtype} {v.layout} tensor")
            tensors.append(v.detach().to("cpu").contiguous())
            return {"$t": len(tensors) - 1}
        if isinstance(v, UserDict):  # BatchedDataDict (nemo_rl's or the mirror)
            return {"$b": tree(dict(v.data), where)}
        if isinstance(v, Mapping):
            items = []
            for k, x in v.items():
                if not (k is None or isinstance(k, bool | int | float | str)):
                    raise PayloadError(f"{where}: cannot encode a key of type {type(k).__name__}")
                items.append([k, tree(x, f"{where}[{k!r}]")])
            return {"$d": items}
        if isinstance(v, list):
            return [tree(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {"$u": [tree(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        item = getattr(v, "item", None)  # numpy scalars
        if type(v).__module__ == "numpy" and callable(item) and getattr(v, "ndim", 1) == 0:
            return tree(item(), where)
        raise PayloadError(f"{where}: cannot encode {type(v).__name__} (no pickle here)")

    root = tree(obj, "trajectory")
    metas: list[list[Any]] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append([str(t.dtype), list(t.shape), offset, nbytes])
        spans.append((offset, nbytes))
        offset += nbytes
    header = json.dumps({"format": PAYLOAD_FORMAT, "tree": root, "tensors": metas}).encode()
    out = torch.empty(8 + len(header) + offset, dtype=torch.uint8)
    out[:8] = torch.tensor(list(len(header).to_bytes(8, "little")), dtype=torch.uint8)
    out[8 : 8 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    base = 8 + len(header)
    for t, (off, nbytes) in zip(tensors, spans, strict=True):
        if nbytes:
            out[base + off : base + off + nbytes] = t.reshape(-1).view(torch.uint8)
    return out


def decode_payload(payload: torch.Tensor) -> Any:
    """The object :func:`encode_payload` encoded; malformed bytes raise :class:`PayloadError`.

    Example:
        >>> decode_payload(encode_payload((1, None, float("nan"))))
        (1, None, nan)
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.ndim != 1:
        raise PayloadError(f"payload: expected a 1-D uint8 tensor, found {payload!r:.80}")
    raw = payload.numpy().tobytes()
    try:
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8 : 8 + n].decode())
        if head.get("format") != PAYLOAD_FORMAT:
            raise PayloadError(
                f"payload: expected format {PAYLOAD_FORMAT!r}, found {head.get('format')!r}"
            )
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise PayloadError(f"payload: not a {PAYLOAD_FORMAT} payload ({e})") from None
    base = 8 + n
    metas = head.get("tensors") if isinstance(head, dict) else None
    if not isinstance(metas, list):
        raise PayloadError(f"payload: expected a header with a 'tensors' list, found {metas!r:.80}")
    tensors = []
    for meta in metas:
        try:
            dtype, shape, off, nbytes = meta
            shape = [int(d) for d in shape]
            off, nbytes = int(off), int(nbytes)
        except (TypeError, ValueError) as e:
            raise PayloadError(f"payload: malformed tensor entry {meta!r:.80} ({e})") from None
        if off < 0 or nbytes < 0 or base + off + nbytes > len(raw) or dtype not in _DTYPES:
            raise PayloadError(f"payload: tensor at {off} ({dtype}, {nbytes} bytes) out of bounds")
        width = _DTYPES[dtype].itemsize
        if any(d < 0 for d in shape) or math.prod(shape) * width != nbytes:
            raise PayloadError(
                f"payload: tensor at {off}: expected {nbytes} bytes for a {dtype} of shape "
                f"{shape}, found {math.prod(shape) * width} bytes"
            )
        buf = bytearray(raw[base + off : base + off + nbytes])
        flat = (
            torch.frombuffer(buf, dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(flat.view(_DTYPES[dtype]).reshape(shape))
    bdd = nemo_rl_or_mirror("BatchedDataDict")

    def build(v: Any) -> Any:
        if isinstance(v, list):
            return [build(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "$t" in v:
            return tensors[v["$t"]]
        if "$f" in v:
            return float(v["$f"])
        if "$b" in v:
            return bdd(build(v["$b"]))
        if "$u" in v:
            return tuple(build(x) for x in v["$u"])
        return {k: build(x) for k, x in v["$d"]}

    try:
        return build(head["tree"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PayloadError(f"payload: malformed tree ({type(e).__name__}: {e})") from None
