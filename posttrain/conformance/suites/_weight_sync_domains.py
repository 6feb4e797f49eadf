"""The models and weights the weight-sync suite syncs (its domains).

The receiver's model is a tiny real HF causal LM with a persistent buffer (and a non-persistent
one, which is not in the ``state_dict``). Two more models widen the domains: :func:`mixed_model`
(every floating dtype, an int64 step counter and a bool mask in one model) and
:func:`wrapped_model` (names under DDP's and torch.compile's wrapper prefixes, beside names that
merely contain them). Beside them, the forms a sent mapping takes: its names' order, its tensors'
storage layout, bit patterns a cast or a comparison would change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.testing import tiny_causal_lm

Weights = dict[str, torch.Tensor]


BUFFER = "conformance_stats"  # persistent: in the state_dict, so it is synced like a weight
SCRATCH = "conformance_scratch"  # non-persistent: not in the state_dict, never sent


def sync_model(seed: int) -> Any:
    """The suite's model: a tiny HF causal LM with a persistent and a non-persistent buffer.

    The persistent buffer (float statistics, as BatchNorm's running mean) is part of the
    ``state_dict`` and must be synced as every parameter is; the non-persistent one is not in
    it, and a receiver must not ask for it.

    Example:
        >>> m = sync_model(0)
        >>> BUFFER in m.state_dict(), SCRATCH in m.state_dict()
        (True, False)
    """
    model = tiny_causal_lm(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    model.register_buffer(BUFFER, torch.randn(4, generator=gen), persistent=True)
    model.register_buffer(SCRATCH, torch.randn(4, generator=gen), persistent=False)
    return model


# The integer buffers a model may hold beside its floats (WS-001/WS-005's domain): a 0-d int64
# step counter (as BatchNorm's num_batches_tracked) holding a value past 2**53, which a round
# trip through float64 changes, and a bool mask.
STEPS, MASK = "conformance_steps", "conformance_mask"


def mixed_model(seed: int) -> Any:
    """The suite's model with every floating dtype in it and integer buffers beside them.

    float16 and bfloat16 (the same width) sit in same-shaped tensors, float64 in the head,
    float32 in the rest; a 0-d int64 step counter and a bool mask are persistent buffers.

    Example:
        >>> sd = mixed_model(0).state_dict()
        >>> sorted({str(t.dtype) for t in sd.values()})  # doctest: +NORMALIZE_WHITESPACE
        ['torch.bfloat16', 'torch.bool', 'torch.float16', 'torch.float32', 'torch.float64',
         'torch.int64']
        >>> sd[STEPS].shape, sd[STEPS].item() > 2**53
        (torch.Size([]), True)
    """
    model = sync_model(seed)
    layer = model.model.layers[0]
    model.model.embed_tokens.to(torch.bfloat16)
    layer.self_attn.q_proj.to(torch.float16)
    layer.self_attn.k_proj.to(torch.bfloat16)
    layer.self_attn.v_proj.to(torch.float16)
    layer.input_layernorm.to(torch.bfloat16)
    layer.post_attention_layernorm.to(torch.float16)
    layer.mlp.down_proj.to(torch.float64)
    model.lm_head.to(torch.float64)
    gen = torch.Generator().manual_seed(seed + 7)
    model.register_buffer(STEPS, torch.tensor(2**62 + 2 * seed + 1, dtype=torch.int64))
    model.register_buffer(MASK, torch.rand(16, generator=gen) < 0.5)
    return model


# Wrapper prefixes a trainer's names carry (WS-001/WS-006's domain): DDP's and FSDP's
# ``module.``, torch.compile's ``_orig_mod.``, and the two nested either way.
WRAPPERS = ("module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.")


def wrapped_model(seed: int) -> Any:
    """The suite's model under wrapper prefixes, beside names that merely contain them.

    Its names: ``module._orig_mod.<the suite's model>`` (DDP around torch.compile),
    ``_orig_mod.module.weight`` (the other nesting), ``submodule.weight`` and
    ``not_orig_mod.weight`` (the substrings mid-name) and a plain ``head.weight``.

    Example:
        >>> [n for n in wrapped_model(0).state_dict() if not n.startswith("module.")]
        ['_orig_mod.module.weight', 'submodule.weight', 'not_orig_mod.weight', 'head.weight']
    """
    root, ddp, compiled = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    ddp.add_module("_orig_mod", sync_model(seed))
    root.add_module("module", ddp)
    compiled.add_module("module", torch.nn.Linear(4, 4, bias=False))
    root.add_module("_orig_mod", compiled)
    root.add_module("submodule", torch.nn.Linear(4, 2, bias=False))
    root.add_module("not_orig_mod", torch.nn.Linear(2, 2, bias=False))
    root.add_module("head", torch.nn.Linear(2, 3, bias=False))
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name in ("_orig_mod", "submodule", "not_orig_mod", "head"):
            for p in getattr(root, name).parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    return root


MODELS: dict[str, Callable[[int], Any]] = {
    "float32": sync_model,
    "mixed": mixed_model,
    "wrapped": wrapped_model,
}
"""The receiver models the suite syncs, by kind (see each builder)."""


def fresh_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """New values of ``t``'s dtype and shape: floats moved by noise, integers over their whole
    range, bools at random."""
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) < 0.5
    if t.is_floating_point():
        return t + torch.randn(t.shape, generator=gen).to(t.dtype)
    info = torch.iinfo(t.dtype)
    return torch.randint(info.min, info.max, t.shape, generator=gen, dtype=t.dtype)


def bump_(t: torch.Tensor, delta: float) -> None:
    """Change every element of ``t`` in place, as a training step does (bools flip)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point():
        t.add_(delta)
    else:
        t.add_(1)


def stepped(weights: Weights, delta: float) -> Weights:
    """A copy of ``weights`` with every element changed (see :func:`bump_`)."""
    out = {n: t.detach().clone() for n, t in weights.items()}
    with torch.no_grad():
        for t in out.values():
            bump_(t, delta)
    return out


# The forms a sent state dict takes (WS-001's domain): the tensors' own layout, as views at
# an offset into one flat buffer (a flattened parameter store), or non-contiguous (a transpose).
LAYOUTS = ("contiguous", "offset_views", "non_contiguous")
# Values whose bits a cast, a reduction or a sum of partial copies would change.
SPECIALS = (float("nan"), -float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0e38)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def specials(weights: Weights) -> Weights:
    """``weights`` with the special values written over the first elements of each tensor."""
    out = {}
    for n, t in weights.items():
        t = t.detach().clone()
        if not t.is_floating_point():
            out[n] = t
            continue
        flat = t.view(-1)
        k = min(len(SPECIALS), flat.numel())
        flat[:k] = torch.tensor(SPECIALS[:k], dtype=torch.float64).to(t.dtype)
        out[n] = t
    return out


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}


def zeros_and_nans(weights: Weights, seed: int) -> Weights:
    """``weights`` with about half of each tensor's elements +0.0 or -0.0, and NaNs in every
    other tensor: the tensors without NaN compare equal (``==``, ``torch.equal``) to their
    :func:`equal_twin`, the others equal with ``equal_nan``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (n, t) in enumerate(weights.items()):
        t = t.detach().clone()
        at = torch.rand(t.shape, generator=gen) < 0.5
        sign = -1.0 if seed % 2 else 1.0  # -0.0 then +0.0, or +0.0 then -0.0
        t[at] = torch.tensor(sign * 0.0, dtype=t.dtype)
        if i % 2:
            t[torch.rand(t.shape, generator=gen) < 0.2] = float("nan")
        out[n] = t
    return out


def equal_twin(weights: Weights) -> Weights:
    """The same values with other bits: every zero and NaN has its sign flipped, and every NaN
    its lowest payload bit. A receiver that skips a tensor comparing equal to what it holds
    (a delta sync) keeps the old bits."""
    out = {}
    for n, t in weights.items():
        ints = _BITS.get(t.dtype, torch.int16 if t.element_size() == 2 else None)
        if ints is None or not t.is_floating_point():
            out[n] = t.detach().clone()
            continue
        bits = t.detach().clone().view(ints)
        nan, zero = torch.isnan(t), t == 0
        bits[nan | zero] ^= torch.iinfo(ints).min  # the sign bit
        bits[nan] ^= 1  # the payload's lowest bit (a quiet NaN stays a NaN)
        out[n] = bits.view(t.dtype)
    return out


def laid_out(weights: Weights, layout: str) -> Weights:
    """The same values, stored as ``layout`` says (see LAYOUTS)."""
    if layout == "contiguous":
        return {n: t.detach().clone() for n, t in weights.items()}
    if layout == "offset_views":  # one flat buffer per dtype
        flats: dict[torch.dtype, torch.Tensor] = {}
        at: dict[torch.dtype, int] = {}
        for t in weights.values():
            at[t.dtype] = at.get(t.dtype, 3) + t.numel()
        for dtype, total in at.items():
            flats[dtype], at[dtype] = torch.zeros(total, dtype=dtype), 3
        out = {}  # every view starts past its storage's first element
        for n, t in weights.items():
            start = at[t.dtype]
            out[n] = flats[t.dtype][start : start + t.numel()].view(t.shape)
            out[n].copy_(t)
            at[t.dtype] = start + t.numel()
        return out
    out = {}
    for n, t in weights.items():
        if t.ndim >= 2:
            strided = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(
                *reversed(range(t.ndim))
            )
        else:
            strided = torch.empty(t.numel() * 2, dtype=t.dtype)[::2].view(t.shape)
        strided.copy_(t)
        out[n] = strided
    return out


def ordered(weights: Weights, order: list[int]) -> Weights:
    names = list(weights)
    return {names[i]: weights[names[i]] for i in order}


def same_shape_swaps(weights: Weights) -> list[int]:
    """An order that swaps neighbouring tensors of the same shape (and keeps the others)."""
    names = list(weights)
    order = list(range(len(names)))
    by: dict[tuple[Any, ...], list[int]] = {}
    for i, n in enumerate(names):
        by.setdefault((tuple(weights[n].shape), weights[n].dtype), []).append(i)
    for idx in by.values():
        for a, b in zip(idx[::2], idx[1::2], strict=False):
            order[a], order[b] = order[b], order[a]
    return order


def kinds(weights: Weights) -> str:
    """The dtypes of ``weights``, in words."""
    return ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}))


def variant(weights: Weights, k: int) -> Weights:
    """``weights`` with ``k`` added to every floating tensor: each version sends its own."""
    return {n: t + k if t.is_floating_point() else t.clone() for n, t in weights.items()}
