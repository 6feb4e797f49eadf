"""Any ``ReplayBufferV1`` as a dataset for Hugging Face trainers (TRL's included).

A batch is sampled once and turned into rows column by column: one tensor operation per
column, then one ``zip`` (torchrl's ``TorchRLBufferDataset`` indexes ``batch[i]`` per row and
fails on the ragged lazy stacks ``LLMCollector`` produces).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import uuid
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, ClassVar, Literal

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase

from posttrain._args import positive_int
from posttrain._deps import optional_deps
from posttrain.adapters._layout import fill_mask, pad_values
from posttrain.contracts.buffer import ReplayBufferV1
from posttrain.contracts.keys import Key, key_str, leaf_column, leaf_items, norm_key
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.errors import PosttrainError

IGNORE_INDEX = -100
"""The label of a position the loss skips (``transformers``' and TRL's convention)."""

Shape = Literal["padded", "ragged"]
Values = Literal["tensor", "numpy", "list"]


class MissingKey(PosttrainError, KeyError):
    """A column's key is not in the sampled batch (the message names key and what was found).

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.testing import llm_batch
        >>> rb = RingBuffer(4); _ = rb.extend(llm_batch(4))
        >>> ds = BufferDataset(rb, 2, columns={"ids": "input_ids"})  # layout: ("tokens", "full")
        >>> next(iter(ds))
        Traceback (most recent call last):
        ...
        posttrain...MissingKey: column 'ids': key 'input_ids' is not in the sampled batch; found ...
    """

    def __str__(self) -> str:
        return str(self.args[0])


class WorkerRefused(PosttrainError, RuntimeError):
    """A :class:`BufferDataset` was asked to run in a ``DataLoader`` worker process.

    Example:
        >>> import pickle
        >>> from posttrain.reference_impls import RingBuffer
        >>> pickle.dumps(BufferDataset(RingBuffer(4), 2))  # how a spawned DataLoader worker gets it
        Traceback (most recent call last):
        ...
        posttrain...WorkerRefused: BufferDataset samples a live buffer ...; set num_workers=0 ...
    """


_WORKERS = (
    "BufferDataset samples a live buffer and must run in the process that fills it; set "
    "num_workers=0 (dataloader_num_workers=0). A worker would sample a copy: a pickled one "
    "under spawn (which `import torchrl` selects) or a fork-time snapshot of an in-memory "
    "buffer that never sees later extends. Sampling here is column-first and costs less than "
    "a worker's transfer; for multi-process reads put the buffer in shared memory or behind "
    "a server."
)


class BufferDataset(torch.utils.data.IterableDataset[dict[str, Any]]):
    """Rows sampled from a replay buffer, for ``transformers.Trainer`` and TRL trainers.

    Each iteration yields ``num_batches * batch_size`` rows (``None``: forever), one ``dict``
    per item, sampling ``batch_size`` items at a time (see :meth:`rows` for rows an iterator
    leaves unread). ``columns`` maps row names to keys (default: every leaf,
    nested keys joined with ``"."``). ``shape="padded"`` gives every row of a batch the same
    length (ragged batches are right-padded to the batch's longest item: token ids with
    ``pad_token_id``, masks with ``False``, floats with 0, labels with ``IGNORE_INDEX``);
    ``shape="ragged"`` cuts each row's per-token columns to its attention mask, so collators
    that rebuild the attention mask from lengths (TRL's do) never see a pad. ``labels`` names
    a column of token ids where the assistant mask holds and ``IGNORE_INDEX`` elsewhere.

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.testing import llm_batch
        >>> rb = RingBuffer(8); _ = rb.extend(llm_batch(8))
        >>> ds = BufferDataset(rb, 4, columns={"input_ids": ("tokens", "full")}, labels="labels")
        >>> rows = list(ds)
        >>> len(rows), sorted(rows[0]), rows[0]["input_ids"].shape
        (4, ['input_ids', 'labels'], torch.Size([8]))
    """

    def __init__(
        self,
        buffer: ReplayBufferV1,
        batch_size: int,
        *,
        num_batches: int | None = 1,
        columns: Mapping[str, Key] | None = None,
        shape: Shape = "padded",
        labels: str | None = None,
        pad_token_id: int = 0,
        layout: Layout = LLM_LAYOUT_V1,
    ) -> None:
        batch_size = positive_int("batch_size", batch_size)
        if num_batches is not None:
            num_batches = positive_int("num_batches", num_batches)
        if shape not in ("padded", "ragged"):
            raise ValueError(f"shape: expected 'padded' or 'ragged', found {shape!r}")
        self.buffer = buffer
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.columns = None if columns is None else {n: norm_key(k) for n, k in columns.items()}
        if labels is not None and self.columns is not None and labels in self.columns:
            raise ValueError(f"labels: column {labels!r} is also in columns")
        self.shape: Shape = shape
        self.labels = labels
        self.pad_token_id = pad_token_id
        self.layout = layout
        self._carry: collections.deque[_Pending] = collections.deque()

    # A copy would sample a snapshot of the buffer: datasets' ``shuffle``/``map`` deep-copy
    # their generator's arguments, and DataLoader workers pickle the dataset.
    def __deepcopy__(self, memo: dict[int, Any]) -> BufferDataset:
        return self

    def __reduce__(self) -> Any:
        raise WorkerRefused(_WORKERS)

    def __iter__(self) -> Generator[dict[str, Any], None, None]:
        return self.rows("tensor")

    def rows(self, values: Values = "tensor") -> Generator[dict[str, Any], None, None]:
        """Yield up to ``num_batches * batch_size`` rows, values as tensors, numpy arrays or lists.

        Rows come first from batches an earlier iterator drew but did not finish (whatever
        value type it used), then from new samples. An iterator that stops (closed early or
        at its limit) leaves its unread rows for the next one; one closed after its first row
        alone gives that row back too: the ``next(iter(ds))`` peek that SFTTrainer and many
        tools do at set-up costs nothing. The trade-off: a consumer that really uses exactly
        one row and then closes its iterator will see that row again.
        """
        if torch.utils.data.get_worker_info() is not None:
            raise WorkerRefused(_WORKERS)
        limit = None if self.num_batches is None else self.num_batches * self.batch_size
        yielded = 0
        current: _Pending | None = None
        rows: list[dict[str, Any]] = []
        i = 0
        try:
            while limit is None or yielded < limit:
                if current is None or i == len(rows):
                    current = self._carry.popleft() if self._carry else self._draw()
                    rows = current.rows(values)
                    i = 0
                i += 1
                yielded += 1
                yield rows[i - 1]
        except GeneratorExit:
            if yielded == 1:
                i -= 1
            raise
        finally:
            if current is not None and i < len(rows):
                self._carry.appendleft(current.advanced(i))

    def _draw(self) -> _Pending:
        names, cols = self.batch_columns(self.buffer.sample(self.batch_size))
        return _Pending(names, cols, 0)

    def batch_columns(self, batch: TensorDictBase) -> tuple[list[str], list[Any]]:
        """Column names and, per column, one value per row: a stacked tensor or a list."""
        if isinstance(batch, LazyStackedTensorDict) and batch.stack_dim == 0:
            return self._ragged_columns(batch)
        return self._dense_columns(batch)

    def _wanted(self, available: Mapping[tuple[str, ...], Any]) -> dict[str, tuple[str, ...]]:
        cols = self.columns
        if cols is None:
            return {".".join(k): k for k in available}
        for name, key in cols.items():
            if key not in available:
                raise MissingKey(
                    f"column {name!r}: key {key_str(key)} is not in the sampled batch; "
                    f"found {', '.join(sorted(key_str(k) for k in available))}"
                )
        return cols

    def _need(self, available: Mapping[tuple[str, ...], Any], field: str) -> tuple[str, ...]:
        key = self.layout.key(field)
        if key not in available:
            raise MissingKey(
                f"{field}: key {key_str(key)} is not in the sampled batch; found "
                f"{', '.join(sorted(key_str(k) for k in available))}"
            )
        return key

    def _dense_columns(self, batch: TensorDictBase) -> tuple[list[str], list[Any]]:
        if batch.batch_dims != 1:
            batch = batch.reshape(-1)
        leaves = leaf_items(batch)
        wanted = self._wanted(leaves)
        tokens = leaves[self._need(leaves, "tokens")]
        t = tokens.shape[-1]
        n_rows = tokens.shape[0]
        values = {n: _dense_leaf(leaves[k], n_rows) for n, k in wanted.items()}
        if self.labels is not None:
            asst = leaves[self._need(leaves, "assistant_mask")]
            values[self.labels] = torch.where(asst, tokens, IGNORE_INDEX)
        if self.shape == "ragged":
            attn = leaves[self._need(leaves, "attention_mask")]
            lengths = attn.sum(-1).tolist()
            for n, v in values.items():
                if isinstance(v, torch.Tensor) and v.ndim == 2 and v.shape[-1] == t:
                    values[n] = torch.split(v[attn], lengths)
        return list(values), list(values.values())

    def _ragged_columns(self, batch: LazyStackedTensorDict) -> tuple[list[str], list[Any]]:
        tds = batch.tensordicts
        first = leaf_items(tds[0])
        wanted = self._wanted(first)
        tok = self._need(first, "tokens")
        values: dict[str, list[Any]] = {n: _column(tds, k) for n, k in wanted.items()}
        tokens = values[_name_of(wanted, tok)] if tok in wanted.values() else _column(tds, tok)
        if self.labels is not None:
            asst = _column(tds, self._need(first, "assistant_mask"))
            values[self.labels] = [
                torch.where(a, t, IGNORE_INDEX) for a, t in zip(asst, tokens, strict=True)
            ]
        shapes = [t.shape for t in tokens]
        counts = [sh[0] for sh in shapes]
        per_token = {
            n
            for n, vs in values.items()
            if type(vs) is not _Plain
            and all(v.ndim >= 1 for v in vs)
            and [v.shape[0] for v in vs] == counts
        }
        if self.shape == "ragged":
            masks = _column(tds, self._need(first, "attention_mask"))
            for n in per_token:
                values[n] = [v[m] for v, m in zip(values[n], masks, strict=True)]
            return list(values), list(values.values())
        out: list[Any] = []
        where = fill_mask(shapes, tokens[0].device)
        for n, vs in values.items():
            if n not in per_token:
                out.append(vs)
                continue
            if n == self.labels:
                fill: float = IGNORE_INDEX
            elif wanted.get(n) == tok:
                fill = self.pad_token_id
            else:
                fill = 0
            out.append(pad_values(vs, fill, where))
        return list(values), out

    def as_hf_dataset(self, features: Any = None, *, typed: bool = False) -> Any:
        """This dataset as a ``datasets.IterableDataset`` (what TRL trainers accept).

        By default rows pass through ``datasets`` untouched, values as numpy arrays (TRL's
        collators and ``with_format("torch")`` take them); ``datasets`` then learns the column
        names from the first row it reads (TRL peeks at it; a peek is given back, see
        :meth:`rows`). ``typed=True`` declares the features instead, from the layout for
        columns whose key is a layout field (pass ``features`` for others): values become
        lists and ``datasets`` encodes every row, about 4x slower.

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> from posttrain.testing import llm_batch
            >>> rb = RingBuffer(4); _ = rb.extend(llm_batch(4))
            >>> ds = BufferDataset(rb, 2, columns={"input_ids": ("tokens", "full")}, labels="labels")
            >>> sorted(ds.as_hf_dataset(typed=True).features)
            ['input_ids', 'labels']
            >>> type(next(iter(ds.as_hf_dataset()))["labels"]).__name__
            'ndarray'
        """
        try:
            import datasets
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "as_hf_dataset needs the datasets package: pip install 'posttrain[trl]'"
            ) from e
        if features is None and typed:
            features = datasets.Features(self._features(datasets))
        values: Values = "list" if features is not None else "numpy"
        out = datasets.IterableDataset.from_generator(
            _hf_rows, features=features, gen_kwargs={"source": _Shared(self), "values": values}
        )
        _warn_on_shuffle(out, self)
        return out

    def _features(self, datasets: Any) -> dict[str, Any]:
        if self.columns is None:
            raise ValueError(
                "as_hf_dataset: columns=None cannot declare features without drawing a sample; "
                "pass columns={name: key} or features=datasets.Features(...)"
            )
        by_key = {f.key: f for f in self.layout.fields}
        out: dict[str, Any] = {}
        for name, key in self.columns.items():
            f = by_key.get(key)
            if f is None or len({s[1:] for s in f.shapes}) != 1:
                raise ValueError(
                    f"as_hf_dataset: column {name!r} (key {key_str(key)}) has no single layout "
                    "dtype/shape; pass features=datasets.Features(...)"
                )
            value = datasets.Value(f.dtype)
            out[name] = datasets.List(value) if f.shapes[0][1:] else value
        if self.labels is not None:
            out[self.labels] = datasets.List(datasets.Value("int64"))
        return out


def _column(tds: list[TensorDictBase], key: tuple[str, ...]) -> list[Any]:
    """One key of every item of a lazy stack (plain TensorDicts read directly, as in leaf_items).

    Non-tensor leaves (strings, lists: ``NonTensorData``) come back as their plain values, in
    a :class:`_Plain` list that the row converters pass through untouched.
    """
    try:
        col = leaf_column(tds, key)
    except (AttributeError, KeyError):
        col = [x.get(key) for x in tds]
    if col and not isinstance(col[0], torch.Tensor):
        return _Plain(_plain(v) for v in col)
    return col


class _Plain(list[Any]):
    """A column of plain Python values (one per row), passed to rows as they are."""


def _plain(v: Any) -> Any:
    # NonTensorData holds one value; a 0-dim NonTensorStack is rare but reads the same way.
    if isinstance(v, NonTensorData):
        return v.data
    if isinstance(v, NonTensorStack):
        return v.tolist()
    return v


def _dense_leaf(v: Any, n_rows: int) -> Any:
    """A dense batch's leaf as a column: tensors as they are, non-tensor leaves as plain values."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, NonTensorStack):
        return _Plain(v.tolist())
    if isinstance(v, NonTensorData):  # one value shared by the whole batch
        return _Plain([v.data] * n_rows)
    return _Plain(v) if isinstance(v, list) else _Plain([v] * n_rows)


def _name_of(wanted: Mapping[str, tuple[str, ...]], key: tuple[str, ...]) -> str:
    return next(n for n, k in wanted.items() if k == key)


class _Pending:
    """A sampled batch, column-first, of which rows ``start`` onwards are not yet read."""

    def __init__(self, names: list[str], cols: list[Any], start: int) -> None:
        self.names, self.cols, self.start = names, cols, start

    def advanced(self, read: int) -> _Pending:
        return _Pending(self.names, self.cols, self.start + read)

    def rows(self, values: Values) -> list[dict[str, Any]]:
        convert = _CONVERT[values]
        per_row = [
            c[self.start :] if type(c) is _Plain else convert(c[self.start :]) for c in self.cols
        ]
        return [dict(zip(self.names, v, strict=True)) for v in zip(*per_row, strict=True)]


class _Shared:
    """Hands the live dataset through datasets' copies of generator arguments.

    ``datasets`` deep-copies them (``shuffle``, ``map``) and pickles them to fingerprint the
    dataset: both give back this same object, found by token in this process; unpickling in
    another process (a DataLoader worker) finds nothing and refuses.
    """

    _live: ClassVar[weakref.WeakValueDictionary[str, _Shared]] = weakref.WeakValueDictionary()

    def __init__(self, dataset: BufferDataset) -> None:
        self.dataset = dataset
        self.token = uuid.uuid4().hex
        _Shared._live[self.token] = self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _find_shared, (self.token,)


def _find_shared(token: str) -> _Shared:
    found = _Shared._live.get(token)
    if found is None:
        raise WorkerRefused(_WORKERS)
    return found


def _hf_rows(source: _Shared, values: Values) -> Iterator[dict[str, Any]]:
    yield from source.dataset.rows(values)


def _to_lists(col: Any) -> list[Any]:
    # One ``tolist`` over a stacked column beats one per row by the number of rows.
    if isinstance(col, torch.Tensor):
        out: list[Any] = col.tolist()
        return out
    return [v.tolist() for v in col]


def _to_tensors(col: Any) -> Any:
    return col.unbind(0) if isinstance(col, torch.Tensor) else col


def _to_numpy(col: Any) -> list[Any]:
    # Row views of one array: numpy makes them ~4x faster than torch's unbind.
    if isinstance(col, torch.Tensor):
        return list(_numpy_ready(col).numpy())
    return [_numpy_ready(v).numpy() for v in col]


def _numpy_ready(t: torch.Tensor) -> torch.Tensor:
    # numpy has no bfloat16; a CUDA tensor must come to the host first.
    t = t.cpu() if t.device.type != "cpu" else t
    return t.float() if t.dtype == torch.bfloat16 else t


_CONVERT: dict[str, Callable[[Any], Any]] = {
    "tensor": _to_tensors,
    "numpy": _to_numpy,
    "list": _to_lists,
}


def sft_dataset(
    buffer: ReplayBufferV1,
    batch_size: int,
    *,
    num_batches: int | None = 1,
    layout: Layout = LLM_LAYOUT_V1,
    typed: bool = False,
    tokenizer: Any = None,
) -> Any:
    """Rows for ``SFTTrainer``, as a ``datasets.IterableDataset``: assistant-only loss either way.

    Real tokens only: each row is cut to its attention mask (TRL's collator makes the
    attention mask from the row's length and would otherwise train on pads). Rows:

    - without ``tokenizer``: ``{"input_ids", "labels"}``, labels ``IGNORE_INDEX`` outside the
      assistant mask. Leave ``SFTConfig(assistant_only_loss=False)``: TRL 1.16 refuses
      ``True`` for rows that are not conversational.
    - with ``tokenizer``: ``{"messages", "input_ids", "assistant_masks"}``, the form TRL 1.16
      prepares for ``assistant_only_loss=True``: ``assistant_masks`` is the buffer's assistant
      mask, which TRL folds into the labels itself (it does so whatever the flag);
      ``messages`` are the item's turns decoded with ``tokenizer`` (runs of assistant tokens
      as ``"assistant"``, the runs between them as ``"user"``), there because TRL reads the
      first row to decide whether the data is conversational. TRL trains on the stored
      ``input_ids``, never on a re-tokenized text, and drops ``messages`` before collating.
      TRL also requires the processing class's chat template to hold ``{% generation %}``
      markers when ``assistant_only_loss=True`` (it is not used to tokenize these rows).

    Packing: ``SFTConfig(packing=True)`` packs through a batched ``map`` of 1,000 rows, drawn
    before the first step; any batched map whose batch needs more than one sample call of
    the buffer is refused (:data:`PACKING_REFUSED`), whatever function it maps.
    ``padding_free=True, max_length=None`` concatenates each batch's rows instead. With
    ``num_batches=1`` packing reads the one sample and is allowed. ``typed=True``: see
    :meth:`BufferDataset.as_hf_dataset`.

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.testing import llm_batch
        >>> rb = RingBuffer(4); _ = rb.extend(llm_batch(4))
        >>> row = next(iter(sft_dataset(rb, 4)))
        >>> len(row["input_ids"]) == len(row["labels"]) <= 8, type(row["labels"]).__name__
        (True, 'ndarray')
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.adapters._hf import word_level_tokenizer
        >>> tok = word_level_tokenizer(tiny_causal_lm().config)
        >>> row = next(iter(sft_dataset(rb, 4, tokenizer=tok)))
        >>> sorted(row), [m["role"] for m in row["messages"]]
        (['assistant_masks', 'input_ids', 'messages'], ['user', 'assistant'])
    """
    if tokenizer is None:
        source = BufferDataset(
            buffer,
            batch_size,
            num_batches=num_batches,
            columns={"input_ids": layout.key("tokens")},
            shape="ragged",
            labels="labels",
            layout=layout,
        )
        out = source.as_hf_dataset(typed=typed)
    else:
        source = BufferDataset(
            buffer,
            batch_size,
            num_batches=num_batches,
            columns={
                "input_ids": layout.key("tokens"),
                "assistant_masks": layout.key("assistant_mask"),
            },
            shape="ragged",
            layout=layout,
        )
        out = _conversational(source, tokenizer, typed)
    _refuse_packing(out, source)
    return out


def _conversational(source: BufferDataset, tokenizer: Any, typed: bool) -> Any:
    """``source``'s rows with their turns decoded into ``messages`` (see :func:`sft_dataset`)."""
    with optional_deps():
        import datasets

    values: Values = "list" if typed else "numpy"

    def rows(source: _Shared) -> Iterator[dict[str, Any]]:
        with contextlib.closing(source.dataset.rows(values)) as inner:
            for row in inner:
                yield {
                    "messages": _turns(tokenizer, row["input_ids"], row["assistant_masks"]),
                    **row,
                }

    features = None
    if typed:
        message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
        features = datasets.Features(
            {"messages": datasets.List(message), **source._features(datasets)}
        )
    out = datasets.IterableDataset.from_generator(
        rows, features=features, gen_kwargs={"source": _Shared(source)}
    )
    _warn_on_shuffle(out, source)
    return out


def _turns(tokenizer: Any, ids: Any, assistant: Any) -> list[dict[str, str]]:
    """Runs of equal assistant-mask value, decoded: ``assistant`` inside the mask, else ``user``."""
    ids, assistant = list(ids), [bool(a) for a in assistant]
    turns: list[dict[str, str]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or assistant[end] != assistant[start]:
            role = "assistant" if assistant[start] else "user"
            turns.append({"role": role, "content": str(tokenizer.decode(ids[start:end]))})
            start = end
    return turns


PACKING_REFUSED = (
    "a batched map of {rows} rows over a replay buffer draws {calls} sample calls of "
    "{batch} items before it yields a row (TRL's SFTConfig(packing=True) packs through such "
    "a map: one step of training samples the buffer far beyond what it trains on and, with "
    "replacement, packs repeats of the same item). Use SFTConfig(packing=False, "
    "padding_free=True, max_length=None): each batch's rows are concatenated without padding "
    "and nothing extra is drawn; for a map of your own, pass batch_size<={batch}."
)
"""The message of the ``ValueError`` raised by a batched map that over-draws a buffer."""


_DERIVING = ("filter", "with_format", "select_columns", "remove_columns", "rename_column",
             "rename_columns", "shuffle", "take", "skip", "cast", "cast_column")  # fmt: skip


def _refuse_packing(out: Any, source: BufferDataset) -> Any:
    """Make ``out``, and every dataset derived from it, refuse a batched map that over-draws.

    Judged by what the map would do to the buffer, not by the function's name: a batched map
    reads ``batch_size`` rows (``datasets``' default 1,000; ``None``: the whole stream) before
    it yields one. TRL 1.16's SFTTrainer with ``packing=True`` selects columns, shuffles and
    calls ``pack_dataset``, one such map; its other preparation maps are row by row.
    """
    map_ = out.map
    signature = inspect.signature(map_)

    def map(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if call.arguments.get("batched"):
            _check_batched_read(source, call.arguments.get("batch_size"))
        return _refuse_packing(map_(*args, **kwargs), source)

    out.map = map
    for name in _DERIVING:
        method = getattr(out, name, None)
        if method is not None:
            setattr(out, name, _deriving(method, source))
    return out


def _check_batched_read(source: BufferDataset, rows: int | None) -> None:
    total = None if source.num_batches is None else source.num_batches * source.batch_size
    if rows is None or rows <= 0:  # datasets: the whole dataset as one batch
        rows = total
    elif total is not None:
        rows = min(rows, total)
    calls = None if rows is None else -(-rows // source.batch_size)
    if calls is None or calls > 1:
        raise ValueError(
            PACKING_REFUSED.format(
                rows="all the" if rows is None else rows,
                calls="endless" if calls is None else calls,
                batch=source.batch_size,
            )
        )


def _deriving(method: Callable[..., Any], source: BufferDataset) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return _refuse_packing(method(*args, **kwargs), source)

    return call


def _warn_on_shuffle(out: Any, source: BufferDataset) -> None:
    """Make ``out.shuffle`` warn when its buffer draws more batches than one sample call."""
    shuffle = out.shuffle

    def guarded(seed: Any = None, generator: Any = None, buffer_size: int = 1000) -> Any:
        total = None if source.num_batches is None else source.num_batches * source.batch_size
        rows = buffer_size if total is None else min(buffer_size, total)
        calls = -(-rows // source.batch_size)
        if calls > 1:
            warnings.warn(
                f"shuffle(buffer_size={buffer_size}) fills its buffer before yielding a row: "
                f"{calls} sample calls of {source.batch_size} items from the replay buffer "
                "before the first step. The buffer's sampler already randomizes: pass "
                "GRPOConfig(shuffle_dataset=False) (or shuffle with buffer_size=batch_size).",
                UserWarning,
                stacklevel=2,
            )
        return shuffle(seed=seed, generator=generator, buffer_size=buffer_size)

    out.shuffle = guarded


def prompt_dataset(
    buffer: ReplayBufferV1,
    tokenizer: Any,
    batch_size: int,
    *,
    num_batches: int | None = 1,
    columns: Mapping[str, Key] | None = None,
    layout: Layout = LLM_LAYOUT_V1,
) -> Any:
    """The prompts of sampled items as a ``datasets.IterableDataset`` for ``GRPOTrainer``.

    Row: ``{"prompt": text, "prompt_ids": ids, **columns}``. ``prompt_ids`` are the real tokens
    before the first assistant token; ``prompt`` is the text that GRPOTrainer's default path
    tokenizes back into exactly those ids: special tokens the tokenizer adds itself (a BOS)
    are left out of the text, so they are not doubled. ``columns={name: key}`` adds leaves of
    the item (strings and lists included, e.g. a ground-truth ``solution``): TRL passes every
    dataset column to reward functions as a keyword argument. Where decoding and
    re-tokenizing cannot give the ids back (BPE merges across the prompt's end), the dataset
    warns once, keeps the first :data:`MISMATCHED_KEPT` such prompts in
    ``posttrain_mismatched`` and counts them all in ``posttrain_decode_stats["mismatched"]``
    (``"evicted"``: prompts dropped from the map below; ``"collided"``: two stored prompts
    that decode to one text, where the map keeps the later one's ids);
    pass the dataset to ``CaptureRollouts(prompt_ids=...)`` to generate from the stored ids
    exactly: it reads ``posttrain_prompt_ids``, the text -> ids map of the latest
    :data:`PROMPT_IDS_KEPT` such prompts (bounded: an endless stream does not grow it).

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.testing import llm_batch
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.adapters._hf import word_level_tokenizer
        >>> rb = RingBuffer(2); _ = rb.extend(llm_batch(2, vocab_size=64))
        >>> tok = word_level_tokenizer(tiny_causal_lm().config)
        >>> row = next(iter(prompt_dataset(rb, tok, 2, columns={"reward": ("next", "reward")})))
        >>> len(row["prompt"].split()) == len(row["prompt_ids"]) == 3, sorted(row)
        (True, ['prompt', 'prompt_ids', 'reward'])
    """
    with optional_deps():
        import datasets

    source, extra = _prompt_source(buffer, batch_size, num_batches, columns, layout)
    added = _added_specials(tokenizer)
    mismatched: list[list[int]] = []  # the first MISMATCHED_KEPT of them
    decode_stats: collections.Counter[str] = collections.Counter()  # all of them

    def rows(source: _Shared) -> Iterator[dict[str, Any]]:
        with contextlib.closing(source.dataset.rows("tensor")) as inner:
            for row in inner:
                asst = row["assistant"]
                first = int(asst.int().argmax()) if asst.any() else len(asst)
                ids = row["tokens"][:first].tolist()
                text = _prompt_text(tokenizer, ids, added)
                if text is None:
                    text = _mismatched(tokenizer, ids, mismatched, decode_stats, texts)
                out = {"prompt": text, "prompt_ids": ids}
                for n in extra:
                    v = row[f"extra:{n}"]
                    out[n] = v.tolist() if isinstance(v, torch.Tensor) else v
                yield out

    texts = _Recent(PROMPT_IDS_KEPT, decode_stats)
    # Declared features only without extra columns: their types are the buffer's to say.
    features = None if extra else _prompt_features(datasets)
    out = datasets.IterableDataset.from_generator(
        rows, features=features, gen_kwargs={"source": _Shared(source)}
    )
    out.posttrain_prompt_ids = texts
    out.posttrain_mismatched = mismatched
    out.posttrain_decode_stats = decode_stats
    _warn_on_shuffle(out, source)
    return out


def _prompt_source(
    buffer: ReplayBufferV1,
    batch_size: int,
    num_batches: int | None,
    columns: Mapping[str, Key] | None,
    layout: Layout,
) -> tuple[BufferDataset, dict[str, tuple[str, ...]]]:
    """The ragged reader of tokens, masks and the ``columns`` ``prompt_dataset`` draws from,
    and those columns by name (one named as a TRL column is refused)."""
    extra = {n: norm_key(k) for n, k in (columns or {}).items()}
    clash = sorted(set(extra) & {"prompt", "prompt_ids", "completion", "completion_ids"})
    if clash:
        raise ValueError(f"columns: {clash} are names TRL gives its own meaning; rename them")
    source = BufferDataset(
        buffer,
        batch_size,
        num_batches=num_batches,
        columns={
            "tokens": layout.key("tokens"),
            "attention": layout.key("attention_mask"),
            "assistant": layout.key("assistant_mask"),
            **{f"extra:{n}": k for n, k in extra.items()},
        },
        shape="ragged",
        layout=layout,
    )
    return source, extra


def _prompt_features(datasets: Any) -> Any:
    """The features of a ``prompt_dataset`` row without extra columns."""
    return datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "prompt_ids": datasets.List(datasets.Value("int64")),
        }
    )


def _mismatched(
    tokenizer: Any,
    ids: list[int],
    mismatched: list[list[int]],
    decode_stats: collections.Counter[str],
    texts: _Recent,
) -> str:
    """The text of prompt ``ids`` that does not survive decode -> re-tokenize, recorded: the
    first warns, the first few are kept, all are counted and mapped from their text."""
    text: str = tokenizer.decode(ids)
    if not mismatched:
        warnings.warn(
            f"prompt_dataset: prompt {ids[:10]} does not survive decode -> "
            "re-tokenize with this tokenizer; GRPOTrainer's default path would "
            "generate from other ids than the reward functions score. Pass "
            "rollout_func=CaptureRollouts(buffer, prompt_ids=this_dataset).",
            UserWarning,
            stacklevel=3,  # the frame iterating the rows generator, not this helper
        )
    # The first few, as examples, and a count: an endless stream of
    # mismatched prompts must not grow a list forever.
    if len(mismatched) < MISMATCHED_KEPT:
        mismatched.append(ids)
    decode_stats["mismatched"] += 1
    # Only these need a map: a text that round-trips gives its ids back
    # to anyone who tokenizes it (CaptureRollouts falls back to that).
    # Two stored prompts decoding to one text share a key: the later wins
    # and CaptureRollouts would give the earlier one its ids. Counted, so a
    # user can see it happen.
    if texts.get(text, ids) != ids:
        decode_stats["collided"] += 1
    texts[text] = ids
    return text


PROMPT_IDS_KEPT = 4096
"""How many prompts ``prompt_dataset``'s ``posttrain_prompt_ids`` maps from text to stored ids:
the latest ones that do not survive decode -> re-tokenize (the others need no map: their text
tokenizes back into their ids). ``CaptureRollouts`` looks a prompt up when TRL hands it back,
a generation batch after it was yielded (plus up to ``GRPOConfig(shuffle_dataset=True)``'s
1,000-row shuffle buffer, where a row stays longer than 4,096 rows with probability
e^-4.1 = 1.7%); a prompt no longer in the map is tokenized from its text."""


class _Recent(collections.OrderedDict[str, list[int]]):
    """A text -> ids map holding the latest ``limit`` texts written (the oldest go first,
    counted in ``stats["evicted"]``)."""

    def __init__(self, limit: int, stats: collections.Counter[str] | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.stats = collections.Counter() if stats is None else stats

    def __setitem__(self, key: str, value: list[int]) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)
            self.stats["evicted"] += 1


MISMATCHED_KEPT = 10
"""How many prompts that do not survive decode -> re-tokenize ``prompt_dataset`` keeps in its
``posttrain_mismatched`` list (the first ones); ``posttrain_decode_stats["mismatched"]``
counts them all."""


def _added_specials(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer(text)`` adds before and after the text's own (a BOS, an EOS)."""
    probe = "a b"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def _prompt_text(tokenizer: Any, ids: list[int], added: tuple[list[int], list[int]]) -> str | None:
    """Text that ``tokenizer(text)`` (TRL's call) turns into ``ids``, or ``None``.

    The ids the tokenizer adds itself are cut from the stored ids before decoding (they come
    back on re-tokenizing); every other special token stays in the text.
    """
    pre, post = added
    body = ids
    if pre and body[: len(pre)] == pre:
        body = body[len(pre) :]
    if post and len(body) >= len(post) and body[len(body) - len(post) :] == post:
        body = body[: len(body) - len(post)]
    text: str = tokenizer.decode(body)
    if list(tokenizer(text)["input_ids"]) == ids:
        return text
    return None
