"""Optional dependencies: the extra that installs each, and an error that names it."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

EXTRAS = {
    "torchrl": "torchrl",
    "trl": "trl",
    "transformers": "trl",
    "datasets": "trl",
    "accelerate": "trl",
    "tensorboard": "observability",
    "mlflow": "observability",
    "wandb": "observability",
    "matplotlib": "observability",
    "ray": "ray",
    "tokenizers": "trl",
}
"""Top-level module -> the ``posttrain[...]`` extra that installs it (pyproject.toml)."""


@contextlib.contextmanager
def optional_deps() -> Iterator[None]:
    """Around a lazy import: a missing optional dependency says which extra installs it.

    Other import errors (a broken install, a missing core dependency) pass unchanged.

    Example:
        >>> import sys
        >>> sys.modules["mlflow"] = None  # as if not installed
        >>> with optional_deps():
        ...     import mlflow
        Traceback (most recent call last):
        ...
        ModuleNotFoundError: mlflow is not installed: pip install 'posttrain[observability]'
        >>> del sys.modules["mlflow"]
        >>> with optional_deps():
        ...     import torchrl.no_such_module
        Traceback (most recent call last):
        ...
        ModuleNotFoundError: torchrl is installed but has no torchrl.no_such_module: pip install -U 'posttrain[torchrl]'

    """
    try:
        yield
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        extra = EXTRAS.get(root)
        if extra is None:
            raise
        try:
            there = importlib.util.find_spec(root) is not None
        except (ImportError, ValueError):  # None in sys.modules, as when hidden on purpose
            there = False
        if there:  # installed, but without that module: another version than posttrain needs
            raise ModuleNotFoundError(
                f"{root} is installed but has no {e.name}: pip install -U 'posttrain[{extra}]'",
                name=e.name,
            ) from e
        raise ModuleNotFoundError(
            f"{root} is not installed: pip install 'posttrain[{extra}]'", name=e.name
        ) from e
