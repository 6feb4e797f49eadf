"""Ray, imported lazily, and the one local cluster the adapters and their tests share."""

from __future__ import annotations

import os
from typing import Any

LOCAL_CLUSTER = {
    "num_cpus": 2,
    "include_dashboard": False,
    "log_to_driver": False,
    "configure_logging": False,  # no handler of its own on a stream pytest may close
    "object_store_memory": 512 * 2**20,
    "namespace": "posttrain",
}
"""``ray.init`` arguments of the loopback-only cluster :func:`ensure_cluster` starts."""

_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for a single-machine instance: at "0" it takes 127.0.0.1 as the node's address,
and its GCS, raylet, object manager and worker servers listen there. Otherwise Ray replaces
127.0.0.1 with the machine's own address on purpose (``ray/_private/services.py``:
``resolve_ip_for_localhost``) and every server listens on all interfaces."""


def ray_module() -> Any:
    """``ray``, or an ImportError that says what to install.

    Example:
        >>> ray_module().__name__
        'ray'
    """
    try:
        import ray
    except ImportError as e:  # pragma: no cover - only without the extra
        raise ImportError("this needs Ray: pip install 'posttrain[ray]'") from e
    return ray


def ensure_cluster(**overrides: Any) -> Any:
    """Join the Ray cluster this process already uses, or start a local one; return ``ray``.

    A cluster started here is one node on this machine, with 2 CPUs and no dashboard, whose
    servers listen on 127.0.0.1 only (unless the caller set ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
    themselves); anything already initialised (``ray.init(address=...)`` by the caller) is left
    as it is.

    Example (not run by the doctests: tests/adapters/ray/test_ray.py owns the cluster's lifetime):
        >>> ray = ensure_cluster()  # doctest: +SKIP
        >>> ray.cluster_resources()["CPU"]  # doctest: +SKIP
        2.0
    """
    ray = ray_module()
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # The environment reaches the processes Ray spawns; the constant was read when ray was
        # imported, possibly before this call, and services.py reads it at call time.
        os.environ.setdefault(_LOCAL_ONLY, "0")
        if os.environ[_LOCAL_ONLY] == "0":
            ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(**{**LOCAL_CLUSTER, **overrides})
    return ray


def ray_get(ref: Any, timeout: float | None) -> Any:
    """``ray.get``, re-raising a remote exception as itself (type and message kept).

    Ray wraps an error raised inside an actor in ``RayTaskError``; the caller of a remote
    ``extend`` should see the same ``ContractViolation`` a local one raises.
    """
    ray = ray_module()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from e
        raise
