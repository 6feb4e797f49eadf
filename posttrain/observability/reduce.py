"""Reductions by (numerator, denominator) pairs: microbatches, steps and ranks add up exactly.

A token mean over a global batch is ``sum(x * mask) / sum(mask)`` of the whole batch; averaging
the microbatches' means instead weights each microbatch equally, whatever its token count (the
"mean of means" the catalogue forbids). :class:`Accumulator` keeps the pairs in float64, and a
standard deviation as merged moments (count, mean, M2), so that 1000 +- 0.01 keeps its spread.
Across ranks each metric combines by its catalogue ``ranks`` rule (:meth:`Accumulator.all_reduce`).
A distribution (reduction ``hist``) keeps its values themselves, so micro-batches and ranks
concatenate exactly and the sink bins once (:meth:`Accumulator.add_hist`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.contracts.catalogue import CATALOGUE_V1, Catalogue

_KINDS: dict[int, tuple[Catalogue, dict[str, tuple[str, str]]]] = {}

HIST_MAX_VALUES = 65_536
"""The most values one accumulator keeps per distribution (sequences of a log window): the
values travel between ranks as text, so an unbounded list would make ``all_reduce`` unbounded."""


def not_a_number(x: Any) -> str:
    """How an error names ``x`` that ``float()`` refused: a tensor by its shape."""
    return (
        f"a tensor of shape {list(x.shape)}"
        if isinstance(x, torch.Tensor)
        else f"{type(x).__name__} {x!r}"
    )


def one_number(where: str, x: Any, expected: str = "one number") -> float:
    """``x`` as one float, or a ``ValueError`` "``where``: expected ..., found ...".

    Example:
        >>> one_number("loss", torch.tensor(0.5, requires_grad=True))
        0.5
        >>> one_number("loss", torch.ones(2))
        Traceback (most recent call last):
        ...
        ValueError: loss: expected one number, found ...
    """
    try:
        # A loss term still holding its graph: its value, without autograd's warning.
        return float(x.detach() if isinstance(x, torch.Tensor) else x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{where}: expected {expected}, found {not_a_number(x)}") from None


def _number(name: str, what: str, x: float | torch.Tensor) -> float:
    return one_number(f"metric {name!r}", x, f"{what} to be one number")


def _count(name: str, what: str, x: float | torch.Tensor) -> float:
    c = _number(name, what, x)
    if not (c >= 0 and math.isfinite(c)):  # NaN fails both
        raise ValueError(f"metric {name!r}: expected {what} to be finite and >= 0, found {c}")
    return c


class Accumulator:
    """Per metric: (sum, count) for ``tok``/``seq``/``rate``, a total for ``sum``, the
    extremum for ``min``/``max``, the latest value for ``last``, merged moments (count, mean,
    M2 in float64) for ``.../std`` and ``.../ess``, the values themselves for ``hist``
    distributions (:meth:`add_hist`); reductions from the catalogue.

    Example:
        >>> acc = Accumulator()
        >>> acc.add("policy/kl_ref/k3", 3.0, 2)   # a microbatch: 2 tokens summing to 3
        >>> acc.add("policy/kl_ref/k3", 1.0, 6)   # another: 6 tokens summing to 1
        >>> acc.values()["policy/kl_ref/k3"]      # 4 / 8, not (1.5 + 0.1667) / 2
        0.5
    """

    def __init__(self, catalogue: Catalogue = CATALOGUE_V1) -> None:
        self.catalogue = catalogue
        # Shared by every accumulator of this catalogue: a loop makes a new one each step, and
        # matching a name against the catalogue is most of what a step's hooks cost otherwise.
        held = _KINDS.get(id(catalogue))
        if held is None or held[0] is not catalogue:
            if len(_KINDS) >= 8:  # catalogues are few; a process making many keeps 8 at most
                _KINDS.clear()
            held = _KINDS[id(catalogue)] = (catalogue, {})
        self._kind: dict[str, tuple[str, str]] = held[1]
        self._num: dict[str, float] = {}
        self._den: dict[str, float] = {}
        self._ext: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._mom: dict[str, tuple[float, float, float]] = {}  # (count, mean, M2)
        self._hist: dict[str, list[float]] = {}

    def _rules(self, name: str) -> tuple[str, str]:
        rules = self._kind.get(name)
        if rules is None:
            parts = name.split("/")
            for m in self.catalogue.metrics:
                pat = m.name.split("/")
                if len(pat) == len(parts) and all(
                    a == b or a == "<reward_fn>" for a, b in zip(pat, parts, strict=True)
                ):
                    rules = (m.reduction, m.ranks)
                    break
            else:
                raise KeyError(f"metric {name!r} is not in catalogue {self.catalogue.name}")
            self._kind[name] = rules
        return rules

    def reduction(self, name: str) -> str:
        """The catalogue's reduction of ``name`` (a ``<reward_fn>`` family member included)."""
        return self._rules(name)[0]

    def ranks(self, name: str) -> str:
        """How ``name`` combines across ranks (the catalogue's ``ranks`` field)."""
        return self._rules(name)[1]

    def add(self, name: str, value: float | torch.Tensor, count: float | torch.Tensor = 1) -> None:
        """Add a numerator and its denominator (``tok``/``seq``/``rate``), or one value.

        A value or count that is not one number, or a count that is negative or not finite,
        raises ``ValueError`` naming the metric, and the accumulator is left as it was. A NaN
        reaching a ``min``/``max`` metric makes it NaN (``min(inf, nan)`` would hide it).

        Example:
            >>> acc = Accumulator()
            >>> acc.add("policy/kl_ref/k3", 1.0, torch.tensor([3, 5]))  # a count per sequence
            Traceback (most recent call last):
            ...
            ValueError: metric 'policy/kl_ref/k3': expected count to be one number, found a tensor of shape [2]
            >>> acc.add("policy/ratio/max", 2.0); acc.add("policy/ratio/max", float("nan"))
            >>> acc.values()
            {'policy/ratio/max': nan}
        """
        kind, rule = self._rules(name)
        if rule == "moments":
            raise ValueError(f"metric {name!r}: expected values through add_values (moments)")
        if kind == "hist":
            raise ValueError(f"metric {name!r}: expected values through add_hist (a distribution)")
        v = _number(name, "value", value)
        if kind in ("tok", "seq", "rate"):
            c = _count(name, "count", count)
            self._num[name] = self._num.get(name, 0.0) + v
            self._den[name] = self._den.get(name, 0.0) + c
        elif kind == "sum":
            self._num[name] = self._num.get(name, 0.0) + v
        elif kind in ("min", "max"):
            self._ext[name] = _extremum(kind, self._ext.get(name), v)
        else:
            self._last[name] = v

    def add_values(self, name: str, values: torch.Tensor) -> None:
        """A metric kept as moments (``.../std``, ``.../ess``): fold in values, in float64.

        Each call's (count, mean, M2) merge with what is held by Chan et al.'s pairwise update,
        never through ``E[x^2] - E[x]^2`` (which cancels to 0 at 1000 +- 0.01).

        Example:
            >>> acc = Accumulator()
            >>> acc.add_values("rollout/reward/std", torch.tensor([1000.01, 999.99], dtype=torch.float64))
            >>> acc.add_values("rollout/reward/std", torch.tensor([1000.01, 999.99], dtype=torch.float64))
            >>> round(acc.values()["rollout/reward/std"], 6)
            0.01
        """
        if self.ranks(name) != "moments":
            raise ValueError(f"metric {name!r}: add_values needs a metric kept as moments")
        if not isinstance(values, torch.Tensor):
            raise ValueError(
                f"metric {name!r}: expected a tensor of values, found {not_a_number(values)}"
            )
        x = values.detach().reshape(-1).to(torch.float64)
        n = x.numel()
        if n == 0:
            return
        mean = x.mean()
        m2 = float(((x - mean) ** 2).sum())
        self._merge_moments(name, (float(n), float(mean), m2))

    def add_hist(self, name: str, values: torch.Tensor | list[float]) -> None:
        """A distribution (catalogue reduction ``hist``): keep ``values``, finite numbers, in
        float64. Micro-batches, steps and ranks concatenate (rank order), so the sink's
        histogram is the one of all values, binned once. A non-finite value, a name of another
        reduction, or more than :data:`HIST_MAX_VALUES` values held raise ``ValueError`` and
        nothing is added.

        Example:
            >>> acc = Accumulator()
            >>> acc.add_hist("rollout/response_len", torch.tensor([3, 5]))
            >>> acc.add_hist("rollout/response_len", [4.0])
            >>> acc.histograms(), acc.values()
            ({'rollout/response_len': [3.0, 5.0, 4.0]}, {})
        """
        if self.reduction(name) != "hist":
            raise ValueError(f"metric {name!r}: add_hist needs a distribution (reduction hist)")
        if isinstance(values, torch.Tensor):
            x = values.detach().reshape(-1).to(torch.float64).tolist()
        else:
            try:
                x = [float(v) for v in values]
            except (TypeError, ValueError):
                raise ValueError(
                    f"metric {name!r}: expected a tensor or list of numbers, found "
                    f"{not_a_number(values)}"
                ) from None
        bad = [v for v in x if not math.isfinite(v)]
        if bad:
            raise ValueError(
                f"metric {name!r}: expected finite values (no backend bins NaN or inf), found "
                f"{len(bad)} non-finite of {len(x)} ({bad[0]})"
            )
        held = self._hist.get(name, [])
        if len(held) + len(x) > HIST_MAX_VALUES:
            raise ValueError(
                f"metric {name!r}: expected at most {HIST_MAX_VALUES} values held, found "
                f"{len(held)} + {len(x)}: log (log_to) and start a new accumulator more often"
            )
        if x:
            self._hist[name] = held + x

    def histograms(self) -> dict[str, list[float]]:
        """Every distribution added (:meth:`add_hist`): name -> its values, in order.

        Example:
            >>> Accumulator().histograms()
            {}
        """
        return {name: list(v) for name, v in self._hist.items()}

    def add_moments(
        self, name: str, total: float | torch.Tensor, squares: float | torch.Tensor, count: float
    ) -> None:
        """A metric kept as moments, from sums of x and x^2 over ``count`` items.

        Prefer :meth:`add_values`: sums of squares lose every digit of a spread that is small
        against the mean. Kept for callers that only hold the sums.
        """
        if self.ranks(name) != "moments":
            raise ValueError(f"{name!r}: add_moments needs a metric kept as moments")
        a, b = _number(name, "total", total), _number(name, "squares", squares)
        c = _count(name, "count", count)
        if c:
            self._merge_moments(name, (c, a / c, max(b - a * a / c, 0.0)))

    def _merge_moments(self, name: str, m: tuple[float, float, float]) -> None:
        held = self._mom.get(name)
        self._mom[name] = m if held is None else _chan(held, m)

    def merge(self, other: Accumulator) -> None:
        """Fold another accumulator (another microbatch or step of this rank) into this one.

        Every name of ``other`` is looked up first: one this catalogue does not hold raises
        ``KeyError``, and a distribution that would pass :data:`HIST_MAX_VALUES` raises
        ``ValueError``, before anything is folded in. Across ranks use :meth:`all_reduce`.
        """
        for name in (*other._num, *other._ext, *other._last, *other._mom, *other._hist):
            self.reduction(name)
        for name, h in other._hist.items():  # a distribution add_hist would refuse: refused now
            held = len(self._hist.get(name, ()))
            if self.reduction(name) != "hist" or held + len(h) > HIST_MAX_VALUES:
                self.add_hist(name, h)  # raises ValueError, adds nothing
        for name, num in other._num.items():
            if name in other._den:
                self.add(name, num, other._den[name])
            else:
                self.add(name, num)
        for name, v in other._ext.items():
            self.add(name, v)
        for name, v in other._last.items():
            self.add(name, v)
        for name, m in other._mom.items():
            self._merge_moments(name, m)
        for name, h in other._hist.items():
            self.add_hist(name, h)

    def state(self) -> dict[str, dict[str, Any]]:
        """What this accumulator holds, as plain floats (what :meth:`all_reduce` exchanges)."""
        return {
            "num": dict(self._num),
            "den": dict(self._den),
            "ext": dict(self._ext),
            "last": dict(self._last),
            "mom": dict(self._mom),
            "hist": {name: list(v) for name, v in self._hist.items()},
        }

    def merge_ranks(self, states: list[dict[str, dict[str, Any]]]) -> None:
        """Replace this accumulator by the ranks' ``states`` (rank order) combined.

        Each metric combines by its catalogue ``ranks`` rule: ``pairs`` sums numerators and
        counts (a count-weighted mean), ``moments`` merges (count, mean, M2), ``sum`` adds,
        ``max`` takes the largest (wall times: ranks run at once), ``rate`` adds the quantity
        and takes the slowest rank's seconds, ``min``/``max`` extremes propagate NaN, ``first``
        keeps the value of the lowest rank holding it, ``concat`` joins the ranks' distribution
        values in rank order. A metric some ranks lack (a rank whose
        rewards were all NaN has no reward min) combines over the ranks that hold it.

        Example:
            >>> a, b = Accumulator(), Accumulator()
            >>> a.add("time/rollout_s", 2.0); b.add("time/rollout_s", 2.0)
            >>> a.add("perf/gen_tokens_per_s", 1000, 2.0); b.add("perf/gen_tokens_per_s", 1000, 2.0)
            >>> a.merge_ranks([a.state(), b.state()])
            >>> a.values()  # 2,000 tokens in the 2 s both ranks ran at once
            {'time/rollout_s': 2.0, 'perf/gen_tokens_per_s': 1000.0}
        """
        num: dict[str, float] = {}
        den: dict[str, float] = {}
        ext: dict[str, float] = {}
        last: dict[str, float] = {}
        mom: dict[str, tuple[float, float, float]] = {}
        hist: dict[str, list[float]] = {}
        for s in states:
            for name, v in s["num"].items():
                rule = self.ranks(name)
                if rule == "max":
                    num[name] = max(num.get(name, -math.inf), v)
                elif rule == "first":
                    num.setdefault(name, v)
                else:
                    num[name] = num.get(name, 0.0) + v
            for name, c in s["den"].items():
                rule = self.ranks(name)
                if rule == "rate":
                    den[name] = max(den.get(name, 0.0), c)
                elif rule == "first":
                    den.setdefault(name, c)
                else:
                    den[name] = den.get(name, 0.0) + c
            for name, v in s["ext"].items():
                ext[name] = _extremum(self.reduction(name), ext.get(name), v)
            for name, v in s["last"].items():
                last.setdefault(name, v)
            for name, (n, mean, m2) in s["mom"].items():
                pos = (float(n), float(mean), float(m2))
                was = mom.get(name)
                mom[name] = pos if was is None else _chan(was, pos)
            for name, vals in s.get("hist", {}).items():
                self.reduction(name)  # a name this catalogue lacks: KeyError, as elsewhere
                hist.setdefault(name, []).extend(float(v) for v in vals)
        self._num, self._den, self._ext, self._last, self._mom = num, den, ext, last, mom
        self._hist = hist

    def all_reduce(self, group: Any = None) -> None:
        """Combine every rank's metrics by the catalogue's ``ranks`` rules; no-op without
        ``torch.distributed``. A collective: every rank of ``group`` must call it; afterwards
        every rank holds the combined values (see :meth:`merge_ranks`).

        Each rank's :meth:`state` travels as JSON bytes in a ``uint8`` tensor (two
        ``all_gather`` calls: the lengths, then the padded bytes), never pickled, so no rank
        can make another run code; floats travel as ``float.hex`` so NaN, infinities and
        every bit of a value survive.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size(group)
        # gloo gathers CPU tensors, nccl only device tensors.
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = _encode_state(self.state())
        size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(t.item()) for t in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=device)
        buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
        bufs = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(bufs, buf, group=group)
        states = [
            _decode_state(bytes(b[: int(n.item())].cpu().tolist()))
            for b, n in zip(bufs, sizes, strict=True)
        ]
        self.merge_ranks(states)

    def values(self) -> dict[str, float]:
        """The reduced value of every metric added (NaN for a ratio with nothing counted)."""
        out: dict[str, float] = {}
        for name, num in self._num.items():
            if name in self._den:
                den = self._den[name]
                out[name] = num / den if den else math.nan
            else:
                out[name] = num
        out.update(self._ext)
        out.update(self._last)
        for name, (n, mean, m2) in self._mom.items():
            if name.endswith("/ess"):
                # (sum w)^2 / (n sum w^2) = mean^2 / E[w^2]: 1 when every weight is equal.
                second = m2 / n + mean * mean
                out[name] = mean * mean / second if second else math.nan
            else:
                out[name] = math.sqrt(m2 / n)
        return out

    def log_to(self, sink: Any, step: int) -> Mapping[str, float]:
        """Write every value to a ``MetricSinkV1`` at ``step``, and every distribution to its
        ``log_histogram`` (MET-008); return the scalar values.

        Distributions to a sink without ``log_histogram`` (MLflow) raise ``TypeError`` before
        anything is written: a dashboard missing its histograms should not look complete.

        Example:
            >>> import tempfile
            >>> from posttrain.reference_impls import JsonlSink
            >>> from posttrain.reference_impls.jsonl_sink import read_jsonl_histograms
            >>> acc = Accumulator(); acc.add_hist("rollout/reward", [0.0, 1.0, 1.0])
            >>> d = tempfile.mkdtemp(); sink = JsonlSink(d)
            >>> acc.log_to(sink, step=2); sink.close()
            {}
            >>> read_jsonl_histograms(d)["rollout/reward"][0][1]["values"]
            [0.0, 1.0, 1.0]
        """
        hist = self.histograms()
        if hist:
            log_histogram = histogram_writer(sink)
        vals = self.values()
        for name, v in vals.items():
            sink.log_scalar(name, v, step=step)
        for name, h in hist.items():
            log_histogram(name, h, step=step)
        return vals


def histogram_writer(sink: Any) -> Any:
    """``sink.log_histogram``; a ``TypeError`` naming the sinks that have one when it is missing."""
    fn = getattr(sink, "log_histogram", None)
    if not callable(fn):
        raise TypeError(
            f"{type(sink).__name__} has no log_histogram: its backend stores scalars only (MLflow "
            "has no histogram type; the hooks' rollout/*/mean, /std, /min and /max are its "
            "summary). Log distributions to a TensorBoard, W&B or JSONL sink, or through Tee"
        )
    return fn


_PARTS = ("num", "den", "ext", "last", "mom", "hist")


def _encode_state(state: Mapping[str, Mapping[str, Any]]) -> bytes:
    """``state`` as UTF-8 JSON, every float as ``float.hex`` (exact, NaN and inf included).

    Example:
        >>> raw = _encode_state({"num": {"a": math.nan}, "mom": {"b": (1.0, 2.0, 0.0)}})
        >>> _decode_state(raw)["num"]["a"], _decode_state(raw)["mom"]["b"]
        (nan, (1.0, 2.0, 0.0))
    """
    out: dict[str, dict[str, Any]] = {}
    for part in _PARTS:
        vals = state.get(part, {})
        if part in ("mom", "hist"):
            out[part] = {k: [float(x).hex() for x in v] for k, v in vals.items()}
        else:
            out[part] = {k: float(v).hex() for k, v in vals.items()}
    return json.dumps(out, sort_keys=True, allow_nan=False).encode("utf-8")


def _decode_state(raw: bytes) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`_encode_state`; refuses anything but names mapped to hex floats."""
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict) or set(data) != set(_PARTS):
        raise ValueError(
            f"decoded a rank's metric state; expected the parts {_PARTS}, found {data!r:.200}"
        )
    out: dict[str, dict[str, Any]] = {}
    for part in _PARTS:
        vals = data[part]
        if not isinstance(vals, dict):
            raise ValueError(
                f"decoded a rank's {part!r}; expected a dict, found {type(vals).__name__}"
            )
        if part == "mom":
            if not all(isinstance(v, list) and len(v) == 3 for v in vals.values()):
                raise ValueError("decoded a rank's moments; expected 3 numbers per metric")
            out[part] = {str(k): tuple(float.fromhex(str(x)) for x in v) for k, v in vals.items()}
        elif part == "hist":
            if not all(isinstance(v, list) for v in vals.values()):
                raise ValueError("decoded a rank's distributions; expected a list per metric")
            out[part] = {str(k): [float.fromhex(str(x)) for x in v] for k, v in vals.items()}
        else:
            out[part] = {str(k): float.fromhex(str(v)) for k, v in vals.items()}
    return out


def _extremum(kind: str, held: float | None, v: float) -> float:
    if held is None or math.isnan(v):
        return v
    if math.isnan(held):
        return held
    return min(held, v) if kind == "min" else max(held, v)


def _chan(
    a: tuple[float, float, float], b: tuple[float, float, float]
) -> tuple[float, float, float]:
    """Chan, Golub and LeVeque's pairwise merge of (count, mean, M2)."""
    na, ma, sa = a
    nb, mb, sb = b
    n = na + nb
    if not n:
        return a
    delta = mb - ma
    return n, ma + delta * nb / n, sa + sb + delta * delta * na * nb / n
