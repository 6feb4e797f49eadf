"""Kept for imports written against it: the tokenizer lives in ``posttrain.adapters._hf``."""

from posttrain.adapters._hf import word_level_tokenizer

__all__ = ["word_level_tokenizer"]
