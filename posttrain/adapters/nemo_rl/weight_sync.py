"""NeMo-RL's ``WeightSynchronizer`` over any ``WeightSyncV1`` sender/receiver pair.

NeMo-RL (``nemo_rl/weight_sync/interfaces.py``, commit 7ea279a) drives weight refits through an
abstract ``WeightSynchronizer``: ``init_communicator()`` once after the policy and the generator
exist, ``sync_weights(*, timer, kv_scales)`` at each refit (``refit_policy_generation`` in
``nemo_rl/algorithms/grpo.py`` calls it when ``policy_generation.weight_synchronizer`` is set
and logs what it returns under ``refit/``), ``is_stale`` (True until a sync succeeds) and
``shutdown()``. Refit info is ``{name: (shape, dtype)}`` (``prepare_refit_info``).

NeMo-RL's weights live in sharded policy workers, each streaming its own shard
(``policy.stream_weights_via_ipc_zmq`` / ``broadcast_weights_for_collective``, one future per
worker); :class:`ShardAssembler` gives each worker a :class:`ShardSender` and hands a version to
the receiver only once every shard of it arrived (``sharded_weight_sync`` is the conformance
factory). :class:`NemoShardedWeightSynchronizer` drives it with the colocated order of
``grpo.py:refit_policy_generation``: ``policy.offload_before_refit()``,
``policy_generation.prepare_for_generation(tags=["weights"])``, the transfer,
``policy.offload_after_refit()``, ``policy_generation.prepare_for_generation(tags=["kv_cache"])``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


class _RefitSequence:
    """The sync sequence both synchronizers share: refit-info check, version, staleness.

    A subclass says what the weights are (``_gather``: the payload and its flat name map),
    how they go out (``_transfer``) and what its ends are (``_ends``, closed by
    ``shutdown``); the colocated offload/wake calls run around the transfer when asked.
    """

    version: int
    kv_scales_sink: Callable[[Mapping[str, float], int], None] | None
    receiver: Any
    receive_timeout: float | None
    colocated: bool = False
    policy: Any = None
    policy_generation: Any = None

    def _start(self) -> None:
        self.version = 0
        self._stale = True
        self._refit_info: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self._closed = False

    def _gather(self) -> tuple[Any, Mapping[str, torch.Tensor]]:
        raise NotImplementedError

    def _transfer(self, payload: Any, version: int) -> None:
        raise NotImplementedError

    def _ends(self) -> tuple[Any, ...]:
        return (self.receiver,)

    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{name: (shape, dtype)}`` of the weights, as NeMo-RL's policy workers report it."""
        return {k: (v.shape, v.dtype) for k, v in self._gather()[1].items()}

    def init_communicator(self) -> None:
        """Record the refit info every later sync is checked against."""
        self._refit_info = self.prepare_refit_info()

    @property
    def is_stale(self) -> bool:
        """True until a sync succeeds, and again after one fails."""
        return self._stale

    def sync_weights(
        self, *, timer: Any = None, kv_scales: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Send the weights as the next version; metrics for NeMo-RL's ``refit/``."""
        if self._closed:
            raise RuntimeError("sync_weights after shutdown()")
        if self._refit_info is None:
            raise RuntimeError("call init_communicator() before sync_weights()")
        _check_kv_scales(kv_scales, self.kv_scales_sink)
        payload, flat = self._gather()
        _check_refit_info(flat, self._refit_info)
        version = self.version + 1
        start = time.perf_counter()
        self._stale = True
        if self.colocated:
            self.policy.offload_before_refit()
            self.policy_generation.prepare_for_generation(tags=["weights"])
        with _timed(timer, "prepare_for_generation/transfer_and_update_weights"):
            self._transfer(payload, version)
            # The sender holds this version now: the next sync must send a later one even if
            # receiving or the kv-scales sink below fails (is_stale stays True then).
            self.version = version
            if self.receiver is not None:
                self.receiver.receive(timeout=self.receive_timeout)
            if kv_scales is not None and self.kv_scales_sink is not None:
                self.kv_scales_sink(dict(kv_scales), version)
        if self.colocated:
            self.policy.offload_after_refit()
            self.policy_generation.prepare_for_generation(tags=["kv_cache"])
        self._stale = False
        return {"weight_sync_s": time.perf_counter() - start, "weight_version": float(version)}

    def shutdown(self) -> None:
        """Close the ends where they can be; idempotent."""
        if self._closed:
            return
        self._closed = True
        for end in self._ends():
            close = getattr(end, "close", None) or getattr(end, "shutdown", None)
            if callable(close):
                close()


class NemoWeightSynchronizer(_RefitSequence):
    """A ``WeightSynchronizer``-shaped object that sends ``state()`` through posttrain's contract.

    ``state`` returns the trainer's current weights (``policy.state_dict`` usually);
    ``receiver.receive`` is called after each send when a receiver is given (in-process pairs;
    a receiver in another process pulls on its own). Each sync sends the next version. A
    failed sync leaves ``is_stale`` True and re-raises (the contract guarantees the receiver
    was not half-written). ``kv_scales`` (FP8 KV-cache scales, which NeMo-RL streams along
    with the weights) go to ``kv_scales_sink(kv_scales, version)`` after the weights landed;
    without a sink they are refused (never dropped).

    Example:
        >>> import torch
        >>> from posttrain.reference_impls import in_process_weight_sync
        >>> trainer, generator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sender, receiver = in_process_weight_sync(generator)
        >>> sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver)
        >>> sync.init_communicator(); sync.is_stale
        True
        >>> sorted(sync.sync_weights()), sync.is_stale, receiver.version
        (['weight_sync_s', 'weight_version'], False, 1)
    """

    def __init__(
        self,
        state: Callable[[], Mapping[str, torch.Tensor]],
        sender: Any,
        receiver: Any = None,
        *,
        receive_timeout: float | None = 30.0,
        kv_scales_sink: Callable[[Mapping[str, float], int], None] | None = None,
    ) -> None:
        self.kv_scales_sink = kv_scales_sink
        self.state = state
        self.sender = sender
        self.receiver = receiver
        self.receive_timeout = receive_timeout
        self._start()

    def _gather(self) -> tuple[Any, Mapping[str, torch.Tensor]]:
        weights = self.state()
        return weights, weights

    def _transfer(self, payload: Any, version: int) -> None:
        self.sender.send(payload, version=version)

    def _ends(self) -> tuple[Any, ...]:
        return (self.sender, self.receiver)


@contextlib.contextmanager
def _timed(timer: Any, label: str) -> Iterator[None]:
    # NeMo-RL's Timer: ``with timer.time(label):``.
    if timer is None:
        yield
        return
    with timer.time(label):
        yield


def _check_refit_info(
    weights: Mapping[str, torch.Tensor], info: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> None:
    now = {k: (v.shape, v.dtype) for k, v in weights.items()}
    if now != info:
        changed = sorted(set(now) ^ set(info)) or sorted(k for k in now if now[k] != info[k])
        raise ValueError(
            f"sync_weights: expected the shapes and dtypes recorded by init_communicator() "
            f"(refit info), found changes for {changed[:5]}"
            + (f" ... and {len(changed) - 5} more" if len(changed) > 5 else "")
        )


def _check_kv_scales(kv_scales: Mapping[str, float] | None, sink: Any) -> None:
    if kv_scales is None:
        return
    if sink is None:
        raise ValueError(
            "kv_scales: given, but no kv_scales_sink= to apply them (they are not dropped)"
        )
    bad = [k for k, v in kv_scales.items() if not isinstance(v, int | float)][:10]
    if bad:
        raise ValueError(f"kv_scales: expected float values, found non-floats for {bad}")


class ShardSender:
    """One policy worker's sender: ``send(shard, version=v)`` with the shard it holds.

    Example:
        >>> from posttrain.reference_impls import in_process_weight_sync
        >>> model = torch.nn.Linear(2, 2)
        >>> sender, receiver = in_process_weight_sync(model)
        >>> asm = ShardAssembler(sender, 2)
        >>> asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=1)
        >>> receiver.receive(timeout=0) is None  # waits for shard 1
        True
        >>> asm.shard_sender(1).send({"bias": torch.zeros(2)}, version=1)
        >>> receiver.receive(timeout=0), model.weight.sum().item()
        (1, 4.0)
    """

    def __init__(self, assembler: ShardAssembler, rank: int) -> None:
        self.assembler = assembler
        self.rank = rank

    def send(self, shard: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Give this worker's shard of ``version`` to the assembler."""
        self.assembler._post(self.rank, shard, version)


class ShardAssembler:
    """Collects one shard per worker for a version, then sends the whole through ``sender``.

    ``sender`` is any ``WeightSenderV1`` (its receiver validates the whole state before a byte
    is copied, so a version is applied whole or not at all). A shard is refused, with the
    shards already held left as they were, when it is not a mapping of names to tensors, when
    its worker already sent one for that version, when it names a tensor another shard of the
    version holds, or when the version is not above the last one completed. Shards are copied
    on arrival: a worker may reuse its tensors.

    Example:
        >>> from posttrain.reference_impls import in_process_weight_sync
        >>> model = torch.nn.Linear(2, 2)
        >>> sender, receiver = in_process_weight_sync(model)
        >>> asm = ShardAssembler(sender, 2)
        >>> asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=1)
        >>> asm.shard_sender(1).send({"weight": torch.ones(2, 2)}, version=1)
        Traceback (most recent call last):
        ...
        ValueError: shard refused: tensors ['weight'] of worker 1 are held by another shard of version 1
        >>> asm.shard_sender(1).send({"bias": torch.zeros(2)}, version=1)  # worker 0's kept
        >>> receiver.receive(timeout=0), model.weight.sum().item()
        (1, 4.0)
    """

    def __init__(self, sender: Any, num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards: expected >= 1, found {num_shards}")
        self.sender = sender
        self.num_shards = num_shards
        self._pending: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self._done = 0
        self._lock = threading.Lock()

    def shard_sender(self, rank: int) -> ShardSender:
        """Worker ``rank``'s sender (``0 <= rank < num_shards``)."""
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank: expected in [0, {self.num_shards}), found {rank}")
        return ShardSender(self, rank)

    def _post(self, rank: int, shard: Mapping[str, torch.Tensor], version: int) -> None:
        if not isinstance(shard, Mapping):
            raise TypeError(
                f"shard: expected a mapping of names to tensors, found {type(shard).__name__}"
            )
        bad = [n for n, t in shard.items() if not isinstance(t, torch.Tensor)][:10]
        if bad:
            raise TypeError(f"shard refused: expected tensors, found non-tensors for {bad}")
        with self._lock:
            if not isinstance(version, int) or version <= self._done:
                raise ValueError(
                    f"version: expected an int above {self._done} (the last version completed), "
                    f"found {version!r}"
                )
            held_shards = self._pending.get(version, {})
            if rank in held_shards:
                raise ValueError(
                    f"shard refused: worker {rank} already sent its shard of version {version}"
                )
            held = {n for s in held_shards.values() for n in s}
            both = sorted(held.intersection(shard))
            if both:
                raise ValueError(
                    f"shard refused: tensors {both[:10]} of worker {rank} are held by another "
                    f"shard of version {version}"
                )
            # Every check passed: only now is anything recorded.
            got = self._pending.setdefault(version, {})
            got[rank] = {n: t.detach().clone() for n, t in shard.items()}
            if len(got) < self.num_shards:
                return
            del self._pending[version]
            whole = {n: t for r in sorted(got) for n, t in got[r].items()}
            # Under the lock: a later version must not overtake this one on its way in. A
            # refused whole (the receiver's check) leaves the last completed version as it was.
            self.sender.send(whole, version=version)
            self._pending = {v: p for v, p in self._pending.items() if v > version}
            self._done = version

    def _drop(self, version: int) -> None:
        # A sync that failed between shard sends: its partial version must not block a retry.
        with self._lock:
            self._pending.pop(version, None)


class ShardedSender:
    """``WeightSenderV1`` over per-worker shards: ``send(weights)`` cuts ``weights`` by owner.

    Worker ``i`` owns the names ``owner(name) == i`` (default: position in sorted order modulo
    the shard count), so a full state dict goes out as ``num_shards`` shard sends; the
    conformance suite runs this path.

    Example:
        >>> from posttrain.reference_impls import in_process_weight_sync
        >>> model = torch.nn.Linear(2, 2)
        >>> inner, receiver = in_process_weight_sync(model)
        >>> sender = ShardedSender(ShardAssembler(inner, 2), owner=lambda n: int(n == "bias"))
        >>> sender.send({"weight": torch.ones(2, 2), "bias": torch.full((2,), 3.0)}, version=1)
        >>> receiver.receive(timeout=0), model.bias.tolist()
        (1, [3.0, 3.0])
    """

    def __init__(
        self, assembler: ShardAssembler, owner: Callable[[str], int] | None = None
    ) -> None:
        self.assembler = assembler
        self.owner = owner

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Send ``weights`` as one shard per worker."""
        if not isinstance(weights, Mapping):
            self.assembler.sender.send(weights, version=version)  # the receiver's own error
            return
        n = self.assembler.num_shards
        names = sorted(weights)
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        for i, name in enumerate(names):
            r = i % n if self.owner is None else self.owner(name)
            shards[r][name] = weights[name]
        for r, shard in enumerate(shards):
            self.assembler.shard_sender(r).send(shard, version=version)


def sharded_weight_sync(model: torch.nn.Module, num_shards: int = 2) -> tuple[ShardedSender, Any]:
    """The conformance factory: ``num_shards`` worker senders into posttrain's receiver.

    Example:
        >>> sender, receiver = sharded_weight_sync(torch.nn.Linear(2, 2), 2)
        >>> sender.send({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, version=1)
        >>> receiver.receive(timeout=0)
        1
    """
    from posttrain.reference_impls import in_process_weight_sync

    inner, receiver = in_process_weight_sync(model)
    return ShardedSender(ShardAssembler(inner, num_shards)), receiver


class NemoShardedWeightSynchronizer(_RefitSequence):
    """NeMo-RL's ``WeightSynchronizer`` where each policy worker sends its own shard.

    ``workers`` expose ``state_shard()`` (the worker's part of the state dict: NeMo-RL's
    sharded policy workers); each sync sends every worker's shard through its
    :class:`ShardSender` as the next version, then ``receiver.receive``. With
    ``colocated=True``, ``policy.offload_before_refit()`` and
    ``policy_generation.prepare_for_generation(tags=["weights"])`` come before the transfer and
    ``policy.offload_after_refit()`` and ``prepare_for_generation(tags=["kv_cache"])`` after
    it, as ``grpo.py:refit_policy_generation`` orders them.

    Example:
        >>> from posttrain.reference_impls import in_process_weight_sync
        >>> model = torch.nn.Linear(2, 2)
        >>> sender, receiver = in_process_weight_sync(model)
        >>> class W:
        ...     def __init__(self, d): self.d = d
        ...     def state_shard(self): return self.d
        >>> sync = NemoShardedWeightSynchronizer(
        ...     [W({"weight": torch.ones(2, 2)}), W({"bias": torch.ones(2)})],
        ...     ShardAssembler(sender, 2), receiver)
        >>> sync.init_communicator(); sync.sync_weights()["weight_version"], model.bias.tolist()
        (1.0, [1.0, 1.0])
    """

    def __init__(
        self,
        workers: list[Any],
        assembler: ShardAssembler,
        receiver: Any = None,
        *,
        colocated: bool = False,
        policy: Any = None,
        policy_generation: Any = None,
        receive_timeout: float | None = 30.0,
        kv_scales_sink: Callable[[Mapping[str, float], int], None] | None = None,
    ) -> None:
        if len(workers) != assembler.num_shards:
            raise ValueError(
                f"workers: expected one per shard ({assembler.num_shards}), found {len(workers)}"
            )
        if colocated and (policy is None or policy_generation is None):
            raise ValueError("colocated=True needs policy= and policy_generation=")
        self.workers = workers
        self.assembler = assembler
        self.receiver = receiver
        self.colocated = colocated
        self.policy = policy
        self.policy_generation = policy_generation
        self.receive_timeout = receive_timeout
        self.kv_scales_sink = kv_scales_sink
        self._start()

    def _gather(self) -> tuple[Any, Mapping[str, torch.Tensor]]:
        shards = [worker.state_shard() for worker in self.workers]
        return shards, {k: v for shard in shards for k, v in shard.items()}

    def _transfer(self, payload: Any, version: int) -> None:
        try:
            for rank, shard in enumerate(payload):
                self.assembler.shard_sender(rank).send(shard, version=version)
        except BaseException:
            # A partial version must not block the retry (the last shard completes it).
            self.assembler._drop(version)
            raise
