"""Set-up for every pytest run from the checkout: the tests and the package's doctests."""

from __future__ import annotations

import os

# TorchRL binds its log handler to sys.stdout when first imported. Were that inside a doctest,
# its INFO lines ("Initialized LazyTensorStorage ...") would land in the example's output and
# fail it, depending on which test imported TorchRL first; on stderr doctest does not see them.
os.environ.setdefault("TORCHRL_CONSOLE_STREAM", "stderr")
