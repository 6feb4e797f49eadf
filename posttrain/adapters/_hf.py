"""Hugging Face helpers shared by the adapters: a tokenizer built locally whose ids are a
model's vocabulary (nothing downloaded)."""

from __future__ import annotations

from typing import Any

from posttrain._deps import optional_deps


def word_level_tokenizer(config: Any) -> Any:
    """Token ``i`` is the word ``t<i>``; pad/bos/eos own the model's special ids.

    TorchRL's wrappers in token mode need a tokenizer only for its special ids. The specials
    must own their ids alone: if a ``t<i>`` shared one, ``PreTrainedTokenizerFast`` would add
    the special as a new id beyond the model's vocabulary.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> tok = word_level_tokenizer(tiny_causal_lm().config)
        >>> len(tok), tok.eos_token_id
        (64, 2)
    """
    with optional_deps():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

    specials = {
        "<pad>": config.pad_token_id or 0,
        "<s>": config.bos_token_id or 1,
        "</s>": config.eos_token_id or 2,
    }
    # pad == eos (many real tokenizers): one special owns the id, or the vocab has a hole
    pad = "</s>" if specials["<pad>"] == specials["</s>"] else "<pad>"
    if pad != "<pad>":
        del specials["<pad>"]
    taken = set(specials.values())
    vocab = {f"t{i}": i for i in range(config.vocab_size) if i not in taken} | specials
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast: Any = PreTrainedTokenizerFast  # untyped constructor
    return fast(
        tokenizer_object=tok,
        pad_token=pad,
        bos_token="<s>",
        eos_token="</s>",
        unk_token=pad,
    )
