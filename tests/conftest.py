"""Session set-up shared by the tests."""

from __future__ import annotations

# pytester's in-process runs (tests/test_conformance_plugin.py) drop every module first
# imported inside them. Were transformers' Llama module first imported there, the class
# transformers caches would no longer be the one in sys.modules, and pickling a tiny model
# to another process (the cross-process weight syncs) would fail. Import it up front.
import transformers.models.llama.modeling_llama  # noqa: F401
