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
    return prepare_payload(obj).tensor()


def prepare_payload(obj: Any) -> PreparedPayload:
    """:func:`encode_payload` up to the copy of the tensor bytes: ``obj`` checked (a
    :class:`PayloadError` naming where), its header built, its size known.

    A buffer learns how many items a group needs before it copies a byte, so a group it has
    no room for costs no copy.

    Example:
        >>> p = prepare_payload({"x": torch.arange(4)})
        >>> p.nbytes == encode_payload({"x": torch.arange(4)}).numel(), p.rows(64).shape
        (True, torch.Size([3, 64]))
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
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append([str(t.dtype), list(t.shape), offset, nbytes])
        offset += nbytes
    header = json.dumps({"format": PAYLOAD_FORMAT, "tree": root, "tensors": metas}).encode()
    return PreparedPayload(len(header).to_bytes(8, "little") + header, tensors, metas, offset)


class PreparedPayload:
    """A checked payload before its bytes are laid out (:func:`prepare_payload`).

    ``nbytes`` is the payload's size; :meth:`chunks` says how many rows of a width it takes
    and :meth:`rows` lays the bytes out in them.

    Example:
        >>> p = prepare_payload([1.5, torch.ones(2)])
        >>> decode_payload(p.tensor())
        [1.5, tensor([1., 1.])]
        >>> torch.equal(p.rows(16).reshape(-1)[: p.nbytes], p.tensor()), p.chunks(16), p.nbytes
        (True, 8, 126)
    """

    def __init__(
        self, head: bytes, tensors: list[torch.Tensor], metas: list[list[Any]], body: int
    ) -> None:
        self._head, self._tensors, self._metas = head, tensors, metas
        self.nbytes = len(head) + body

    def chunks(self, width: int) -> int:
        """How many rows of ``width`` bytes hold the payload (at least one)."""
        return max(1, -(-self.nbytes // width))

    def tensor(self) -> torch.Tensor:
        """The payload as one flat uint8 tensor (what :func:`encode_payload` returns)."""
        return self._fill(torch.empty(self.nbytes, dtype=torch.uint8))

    def rows(self, width: int) -> torch.Tensor:
        """The payload as a uint8 [k, width] tensor, the last row zero-padded: one
        allocation, each tensor copied once."""
        k = self.chunks(width)
        out = self._fill(torch.empty(k * width, dtype=torch.uint8))
        out[self.nbytes :] = 0
        return out.reshape(k, width)

    def _fill(self, out: torch.Tensor) -> torch.Tensor:
        base = len(self._head)
        out[:base] = torch.frombuffer(bytearray(self._head), dtype=torch.uint8)
        for t, (_, _, off, nbytes) in zip(self._tensors, self._metas, strict=True):
            if nbytes:
                out[base + off : base + off + nbytes] = t.reshape(-1).view(torch.uint8)
        return out


def decode_payload(payload: torch.Tensor, *, batched_data_dict: Any = None) -> Any:
    """The object :func:`encode_payload` encoded; malformed bytes raise :class:`PayloadError`.

    The tensors come back in memory of their own (one copy of the payload's tensor bytes,
    shared by its tensors), never aliasing ``payload``. ``batched_data_dict`` is the class
    a ``BatchedDataDict`` comes back as; by default :func:`nemo_rl_or_mirror`'s choice, looked
    up once per call that needs it (pass it to decode many payloads with one look-up).

    Example:
        >>> decode_payload(encode_payload((1, None, float("nan"))))
        (1, None, nan)
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.ndim != 1:
        raise PayloadError(f"payload: expected a 1-D uint8 tensor, found {payload!r:.80}")
    size = int(payload.numel())
    try:
        n = int.from_bytes(payload[:8].numpy().tobytes(), "little")
        head = json.loads(payload[8 : 8 + n].numpy().tobytes().decode())
        if head.get("format") != PAYLOAD_FORMAT:
            raise PayloadError(
                f"payload: expected format {PAYLOAD_FORMAT!r}, found {head.get('format')!r}"
            )
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise PayloadError(f"payload: not a {PAYLOAD_FORMAT} payload ({e})") from None
    metas = head.get("tensors") if isinstance(head, dict) else None
    if not isinstance(metas, list):
        raise PayloadError(f"payload: expected a header with a 'tensors' list, found {metas!r:.80}")
    tensors = _tensors(payload, 8 + n, size, metas)
    bdd = [batched_data_dict]

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
            if bdd[0] is None:
                bdd[0] = nemo_rl_or_mirror("BatchedDataDict")
            return bdd[0](build(v["$b"]))
        if "$u" in v:
            return tuple(build(x) for x in v["$u"])
        return {k: build(x) for k, x in v["$d"]}

    try:
        return build(head["tree"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PayloadError(f"payload: malformed tree ({type(e).__name__}: {e})") from None


def _tensors(payload: torch.Tensor, base: int, size: int, metas: list[Any]) -> list[torch.Tensor]:
    """The tensors ``metas`` describe, each checked against the payload's ``size`` bytes.

    The tensor bytes are copied once and the tensors are views of that copy where they lie
    back to back at offsets their dtype divides (as :func:`encode_payload` writes them
    mostly); any other is copied on its own, so no two tensors share bytes.
    """
    checked = []
    for meta in metas:
        try:
            dtype, shape, off, nbytes = meta
            shape = [int(d) for d in shape]
            off, nbytes = int(off), int(nbytes)
        except (TypeError, ValueError) as e:
            raise PayloadError(f"payload: malformed tensor entry {meta!r:.80} ({e})") from None
        if off < 0 or nbytes < 0 or base + off + nbytes > size or dtype not in _DTYPES:
            raise PayloadError(f"payload: tensor at {off} ({dtype}, {nbytes} bytes) out of bounds")
        width = _DTYPES[dtype].itemsize
        if any(d < 0 for d in shape) or math.prod(shape) * width != nbytes:
            raise PayloadError(
                f"payload: tensor at {off}: expected {nbytes} bytes for a {dtype} of shape "
                f"{shape}, found {math.prod(shape) * width} bytes"
            )
        checked.append((_DTYPES[dtype], shape, off, nbytes))
    end = max((off + nbytes for _, _, off, nbytes in checked), default=0)
    body = payload[base : base + end].clone()
    tensors = []
    free = 0  # the body's bytes before this are some earlier tensor's
    for dtype, shape, off, nbytes in checked:
        flat = body[off : off + nbytes]
        if not nbytes:
            flat = torch.empty(0, dtype=torch.uint8)
        elif off < free or off % dtype.itemsize:
            flat = flat.clone()
        else:
            free = off + nbytes
        tensors.append(flat.view(dtype).reshape(shape))
    return tensors
