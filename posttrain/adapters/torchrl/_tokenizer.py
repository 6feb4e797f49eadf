"""Kept for imports written against it: the tokenizer lives in ``posttrain.adapters._hf``."""

from posttrain.adapters._hf import word_level_tokenizer as word_level_tokenizer
