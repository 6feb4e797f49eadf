"""TorchRL's ``DistributedWeightSyncScheme`` (torch.distributed, gloo): receiver in a process.

The receiving model lives in its own process (forked from a server that imported torch once)
that joins torch.distributed's *default* process group as rank 1; a background thread of
TorchRL's applies each send there and acknowledges it through the TCPStore. The scheme carries
no version: as with TorchRL's in-process transports, the version is kept beside the transport
and the receiver reports the version of the last acknowledged send (the ack comes after the
weights are applied).

Because the scheme uses the default process group, one pair at a time per process: building
a pair closes the previous one. Like the Ray scheme, the receiving end expects every tensor
of ``TensorDict.from_module(model)``; the shim adds the non-persistent buffers.

Network exposure: everything the pair listens on is bound to loopback. TorchRL's own store
and torch.distributed's ``env://`` rendezvous listen on every interface (a TCPStore server
binds the wildcard address), and gloo on the address the host name resolves to; here the
scheme's store is a TCPStore served from a socket bound to 127.0.0.1, the process group is
joined through that same store (no second listener, no ``MASTER_ADDR``/``MASTER_PORT`` set),
and gloo is pointed at the loopback interface (``GLOO_SOCKET_IFNAME``, set in this process
only while the group is created). ``receiver.close()`` leaves the group and drops the store,
so the process holds no listener afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import weakref
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from posttrain._deps import optional_deps
from posttrain._forkserver import context as forkserver_context
from posttrain.adapters.torchrl.ray_weight_sync import non_persistent_buffers
from posttrain.adapters.torchrl.weight_sync import CheckedSender, _call_with_timeout, _nested

TIMEOUT_S = 20.0
"""TorchRL's store and process-group timeout for the scheme (its default is 3600 s)."""

START_TIMEOUT_S = 120.0
"""How long the receiving process may take to start and join."""

_LIVE: weakref.WeakSet[DistReceiver] = weakref.WeakSet()


class _Context:
    # What TorchRL's receiving end resolves the model from (getattr(context, model_id)); it
    # must be weak-referenceable and outlive the scheme, which keeps only a weak reference.
    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy
        self.updates = 0

    def update_policy_weights_(self, model_id: str, policy_or_weights: Any) -> None:
        self.updates += 1


def _receiver_main(scheme: Any, model: Any, conn: Any) -> None:
    import torch.distributed as dist

    _no_core_dumps()  # a bad send aborts this process (SIGABRT in gloo), by TorchRL's design
    ctx = _Context(model)
    # Connects to the parent's store at the address it recorded: 127.0.0.1.
    scheme.init_on_receiver(model_id="policy", context=ctx, worker_idx=1)  # rank 1
    conn.send(("imported", os.getpid()))  # the parent joins only now: its timeout is short
    _join_group(scheme._store, rank=1)  # before connect(): TorchRL then joins no group itself
    scheme.connect()
    conn.send(("ready", os.getpid()))
    while True:
        cmd = conn.recv()
        if cmd == "state":
            conn.send({k: v.detach().clone() for k, v in ctx.policy.state_dict().items()})
        else:
            break
    scheme.shutdown()
    dist.destroy_process_group()
    conn.send("bye")


def _no_core_dumps() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


LOOPBACK = "127.0.0.1"
"""The one address the pair listens on."""

_PG_PREFIX = "posttrain/default_pg"


def _loopback_interface() -> str:
    """The loopback interface's name, for gloo (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface among {names}: the pair listens on loopback only")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _join_group(store: Any, rank: int) -> None:
    """Join the default gloo group of two through ``store`` (no ``env://`` listener), gloo
    bound to the loopback interface."""
    import torch.distributed as dist

    with _env(GLOO_SOCKET_IFNAME=_loopback_interface()):
        dist.init_process_group(
            backend="gloo",
            store=dist.PrefixStore(_PG_PREFIX, store),  # type: ignore[attr-defined]
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=TIMEOUT_S),
        )


def _loopback_store(scheme: Any) -> Any:
    """The scheme's master TCPStore, served from a socket bound to 127.0.0.1.

    A TCPStore server binds the wildcard address whatever host name it is given; given a
    listening socket's descriptor it serves that one (and closes it when it is dropped).
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        port: int = sock.getsockname()[1]
        store = dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK,
            port,
            None,
            True,
            timedelta(seconds=TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    scheme._store_port = port
    scheme._store_info = {"host": LOOPBACK, "port": port}  # where the receiver connects
    return store


def _init_sender_on_loopback(scheme: Any, model: torch.nn.Module) -> None:
    """``scheme.init_on_sender`` with the master store on loopback.

    TorchRL 0.14.1 creates the store in ``_make_store(is_master=True, ...)`` on
    ``gethostbyname(gethostname())``, served on every interface; for this one call the
    instance answers that with :func:`_loopback_store` (the instance attribute is removed
    again, so the scheme pickles to the receiver as TorchRL's own).
    """
    own = scheme._make_store

    def make_store(is_master: bool, *args: Any, **kwargs: Any) -> Any:
        return _loopback_store(scheme) if is_master else own(is_master, *args, **kwargs)

    scheme._make_store = make_store
    try:
        scheme.init_on_sender(model_id="policy", num_workers=1, model=model)
    finally:
        del scheme._make_store


class DistSchemeSender:
    """The raw sending end: ``send(weights, version=v)`` onto the scheme's synchronous send.

    Example (not run by the doctests: it spawns a process; see tests/adapters/torchrl/test_dist_weight_sync.py):
        >>> from posttrain.testing import tiny_causal_lm
        >>> sender, receiver = dist_weight_sync_pair(tiny_causal_lm(seed=0))  # doctest: +SKIP
        >>> sender.send(tiny_causal_lm(seed=1).state_dict(), version=4)  # doctest: +SKIP
        >>> sender.completed()[0]  # doctest: +SKIP
        4
        >>> receiver.close()  # doctest: +SKIP
    """

    def __init__(self, scheme: Any, extras: Mapping[str, torch.Tensor]) -> None:
        self.scheme = scheme
        self.extras = dict(extras)
        self._done = (0, 0.0)

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Push ``weights``; returns once the receiver acknowledged applying them."""
        td = _nested({**self.extras, **weights})
        t0 = time.perf_counter()
        _call_with_timeout(
            lambda: self.scheme.send(weights=td), 2 * TIMEOUT_S, "DistributedWeightSyncScheme.send"
        )
        self._done = (version, time.perf_counter() - t0)

    def completed(self) -> tuple[int, float]:
        """The version and duration of the last acknowledged send."""
        return self._done


class DistReceiver:
    """This process's view of the receiving process: version, weights, pid.

    Example (not run by the doctests: it spawns a process; see tests/adapters/torchrl/test_dist_weight_sync.py):
        >>> from posttrain.testing import tiny_causal_lm
        >>> trainer = tiny_causal_lm(seed=1)
        >>> sender, receiver = dist_weight_sync_pair(tiny_causal_lm(seed=0))  # doctest: +SKIP
        >>> sender.send(trainer.state_dict(), version=1); receiver.receive()  # doctest: +SKIP
        >>> got = receiver.state_dict()["lm_head.weight"]  # doctest: +SKIP
        >>> receiver.version, got.equal(trainer.lm_head.weight)  # doctest: +SKIP
        (1, True)
        >>> receiver.close()  # doctest: +SKIP
    """

    def __init__(self, sender: DistSchemeSender, proc: Any, conn: Any, pid: int) -> None:
        self._sender = sender
        self._proc = proc
        self._conn = conn
        self.pid = pid
        self._version = 0
        self.last_sync_s: float | None = None
        self._close = weakref.finalize(self, _stop, sender.scheme, proc, conn)

    def receive(self, timeout: float | None = None) -> None:
        """Adopt the version of the last acknowledged send (applied there by then)."""
        self._version, self.last_sync_s = self._sender.completed()

    @property
    def version(self) -> int:
        """The version of the weights the receiving process holds."""
        return self._version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the receiving model's weights, fetched from its process."""
        if not self._close.alive:
            raise RuntimeError("state_dict: this pair was closed (a newer pair replaces it)")
        if not self._proc.is_alive():
            raise RuntimeError(f"the receiving process died (exit code {self._proc.exitcode})")
        try:
            self._conn.send("state")
            if not self._conn.poll(START_TIMEOUT_S):
                raise TimeoutError("the receiving process did not answer within its timeout")
            out: dict[str, torch.Tensor] = self._conn.recv()
        except (ConnectionError, EOFError) as e:
            # A process that is dying (gloo aborts it on a bad receive) still counts as alive
            # for a moment while its end of the pipe is already gone: say what happened to it.
            self._proc.join(TIMEOUT_S)
            if self._proc.exitcode is not None:
                msg = f"the receiving process died (exit code {self._proc.exitcode})"
                raise RuntimeError(msg) from e
            raise
        return out

    def close(self) -> None:
        """Stop the receiving process and leave the process group (idempotent)."""
        self._close()


def _stop(scheme: Any, proc: Any, conn: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if proc.is_alive():
            scheme._send_instruction("stop")  # TorchRL's receiving thread leaves its loop
            conn.send("stop")
            conn.poll(TIMEOUT_S)
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    with contextlib.suppress(Exception):
        scheme.shutdown()
    # The scheme outlives the pair (the sender holds it): drop its store so that the store's
    # listener closes now, not whenever the scheme is collected.
    for transport in list(getattr(scheme, "_sender_transports", {}).values()):
        transport._store = None
    scheme._store = None


def dist_weight_sync_pair(
    receiver_model: torch.nn.Module, *, adapted: bool = False
) -> tuple[Any, DistReceiver]:
    """A (sender, receiver) pair over ``DistributedWeightSyncScheme`` with gloo on loopback.

    Every listener of the pair is bound to 127.0.0.1 (the module docstring says how), and
    ``receiver.close()`` leaves this process holding none.

    The receiving process gets a copy of ``receiver_model``; read it with
    ``receiver.state_dict()``. Closes any pair this process built before (one default
    process group per process).

    Example (not run by the doctests: it spawns a process; see tests/adapters/torchrl/test_dist_weight_sync.py):
        >>> from posttrain.testing import tiny_causal_lm
        >>> sender, receiver = dist_weight_sync_pair(tiny_causal_lm(), adapted=True)  # doctest: +SKIP
        >>> sender.send(tiny_causal_lm(seed=1).state_dict(), version=2)  # doctest: +SKIP
        >>> receiver.receive(); receiver.version  # doctest: +SKIP
        2
        >>> receiver.close()  # doctest: +SKIP
    """
    with optional_deps():
        from torchrl.weight_update import DistributedWeightSyncScheme

    for old in list(_LIVE):
        old.close()
    scheme: Any = DistributedWeightSyncScheme(backend="gloo", sync=True, timeout=TIMEOUT_S)
    _init_sender_on_loopback(scheme, receiver_model)
    # A trainer that also uses torch.distributed should know this pair holds the default
    # process group while alive.
    # A fresh interpreter per pair spent ~4 s importing torch, TorchRL and the model's
    # module; forked from a server that imported them once, a child starts in well under 1 s.
    # The server forks before any thread starts and the child sets its own environment.
    ctx = forkserver_context(
        ["torch", "torchrl.weight_update", __name__, type(receiver_model).__module__]
    )
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver_main,
        args=(scheme, receiver_model, child),
        daemon=True,
        name="posttrain-weight-receiver",
    )
    proc.start()
    raw = DistSchemeSender(scheme, non_persistent_buffers(receiver_model))
    try:
        # The child imports torch, torchrl and transformers before it can join: wait for that
        # under a long timeout, then join under TorchRL's short one.
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError("the receiving process did not start within its timeout")
        parent.recv()
        _join_group(scheme._store, rank=0)  # with the child, through the loopback store
        scheme.connect()  # the group exists: TorchRL sends the initial weights over it
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError("the receiving process did not join within its timeout")
        _, pid = parent.recv()
    except BaseException:
        _stop(scheme, proc, parent)
        raise
    receiver = DistReceiver(raw, proc, parent, pid)
    _LIVE.add(receiver)
    # CheckedSender only calls send() on what it wraps.
    return (CheckedSender(raw, receiver_model) if adapted else raw), receiver  # type: ignore[arg-type]
