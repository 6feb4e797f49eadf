"""Buffers across processes on a local Ray cluster: posttrain's RemoteBuffer and TorchRL's
Ray-served ReplayBuffer (raw and adapted) through the buffer suite, BUF-023 included.

One cluster for the module (``ray.init(num_cpus=2)``, loopback only), shut down at its end.
"""

from __future__ import annotations

import gc
import pickle
import runpy
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import posttrain.adapters.torchrl.implementations as trl_impls
from posttrain.adapters._ray import ensure_cluster, ray_get
from posttrain.adapters.ray import serve_buffer
from posttrain.adapters.ray.implementations import SERVED_RING_BUFFER
from posttrain.adapters.torchrl import ValidatedReplayBuffer
from posttrain.adapters.torchrl.deviations import RAY_DEVIATIONS, Deviation
from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.contracts import ContractViolation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.reference_impls import RingBuffer
from posttrain.testing import item_uids, llm_batch
from tests.mutants import buffers
from tests.outcomes import own_failures

# Cross-process (Ray, torch.distributed): `make test-distributed` runs these, `make test` not.
pytestmark = pytest.mark.distributed

ATOMICITY = {"BUF-009", "BUF-010", "BUF-011", "BUF-012"}


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[Any]:
    ray = ensure_cluster()
    yield ray
    from ray._private.state import actors

    from posttrain.adapters.ray.implementations import close_shared_host

    close_shared_host()  # the rows' host: none outlives the module, even without the shutdown
    deadline, hosts = time.monotonic() + 30, ["?"]
    while hosts and time.monotonic() < deadline:  # ray.kill returns before the actor is dead
        hosts = [
            a
            for a in actors().values()
            if a["State"] != "DEAD" and a["ActorClassName"] == "BufferHost"
        ]
        time.sleep(0.1)
    ray.shutdown()
    assert not hosts, hosts


def test_served_reference_buffer_conforms_with_many_producers() -> None:
    rep = run(SERVED_RING_BUFFER)
    rows = {r.id: r for r in rep.results}
    assert rep.ok, [r.message for r in rep.results if r.status is not Status.PASS]
    assert rows["BUF-023"].status is Status.PASS
    assert rows["BUF-019"].status is Status.PASS


def test_raw_torchrl_ray_buffer_accepts_a_bad_remote_extend() -> None:
    # TorchRL 0.14.1's Ray service stores what its local buffer stores: the same four
    # atomicity deviations and empty-buffer refusals, and a producer's batch with a key missing
    # lands in the buffer. The whole suite runs: the row's buffers live in one host actor.
    impl = trl_impls.RAW_RAY_LAZY_TENSOR
    assert impl.known_failures == ATOMICITY | {"BUF-015", "BUF-018", "BUF-023"}
    failing = own_failures(impl)
    assert set(failing) == impl.known_failures, failing
    assert "missing was accepted; len is 41, expected 38" in failing["BUF-023"]


def test_adapted_torchrl_ray_buffer_fails_only_dotted_names_on_loads() -> None:
    # The served storage's state arrives with nested names joined by '.' (BUF-018, declared).
    failing = own_failures(trl_impls.ADAPTED_RAY_LAZY_TENSOR)
    assert set(failing) == {"BUF-018"}, failing
    assert "'a.b', ('a', 'b')" in failing["BUF-018"]


def test_replica_per_client_mutant_fails_buf023() -> None:
    rep = run(buffers.MUTANTS["BUF-023"])
    row = {r.id: r for r in rep.results}["BUF-023"]
    assert row.status is Status.FAIL, row
    assert row.message.startswith("BUF-023: ")
    assert "len is 2, expected 38" in row.message


def test_read_then_write_client_mutant_fails_buf023() -> None:
    # Killed only when the producers' extends overlap: this pins that BUF-023 makes them.
    rep = run(buffers.READ_THEN_WRITE)
    row = {r.id: r for r in rep.results}["BUF-023"]
    assert row.status is Status.FAIL, row
    assert "writes landed on each other" in row.message, row.message


def test_remote_rejection_is_the_local_contract_violation_and_changes_nothing() -> None:
    rb = serve_buffer(RingBuffer, 8)
    try:
        first = llm_batch(3, 8)
        rb.extend(first)
        key = LLM_LAYOUT_V1.key("attention_mask")
        with pytest.raises(ContractViolation) as err:
            rb.extend(llm_batch(2, 8, uid_start=10).exclude(key))
        assert err.value.requirement_ids == ["BUF-009"]
        assert str(key) in str(err.value)
        assert len(rb) == 3
        assert rb.extend(llm_batch(1, 8, uid_start=20)).tolist() == [3]
        assert item_uids(rb.read(torch.arange(4))) == [0, 1, 2, 20]
    finally:
        rb.close()


def test_clients_never_free_the_buffer_and_a_closed_one_says_so(cluster: Any) -> None:
    rb = serve_buffer(RingBuffer, 8)
    pid = rb.pid
    client = pickle.loads(pickle.dumps(rb))  # a pickled owner is a client
    client.extend(llm_batch(2, 8))
    client.close()
    del client
    assert len(rb) == 2
    produce = cluster.remote(num_cpus=0)(lambda h: h.extend(llm_batch(1, 8, uid_start=5)).tolist())
    assert cluster.get(produce.remote(rb.client()), timeout=60) == [2]
    rb.close()
    rb.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        len(rb)
    assert pid != __import__("os").getpid()


def test_validated_client_needs_the_schema_fixed_first() -> None:
    rb = trl_impls.ADAPTED_RAY_LAZY_TENSOR.factory(8)
    assert isinstance(rb, ValidatedReplayBuffer)
    with pytest.raises(RuntimeError, match="extend this buffer once"):
        rb.client()
    rb.extend(llm_batch(2, 8))
    client = pickle.loads(pickle.dumps(rb.client()))
    with pytest.raises(ContractViolation, match="BUF-009"):
        client.extend(llm_batch(2, 8, uid_start=9).exclude(LLM_LAYOUT_V1.key("attention_mask")))
    assert client.extend(llm_batch(1, 8, uid_start=30)).tolist() == [2]
    assert len(rb) == 3


@pytest.mark.parametrize("deviation", RAY_DEVIATIONS, ids=lambda d: d.requirements[0])
def test_each_published_ray_repro_still_reproduces(deviation: Deviation) -> None:
    runpy.run_path(str(deviation.path), run_name="__main__")  # as `python <repro>` runs it


def test_torchrl_rows_get_fresh_independent_buffers_from_one_host_process(cluster: Any) -> None:
    from posttrain.adapters.ray.implementations import shared_host

    gc.collect()  # what earlier tests dropped is gone from the host
    host = shared_host()
    before = cluster.get(host.held.remote())
    a = trl_impls.RAW_RAY_LAZY_TENSOR.factory(8)
    b = trl_impls.ADAPTED_RAY_LAZY_TENSOR.factory(8)
    # TorchRL's own RayReplayBuffer and client, each on a buffer of its own
    assert [type(x).__name__ for x in (a, b.rb)] == ["RayReplayBuffer"] * 2
    assert a._rb.key != b.rb._rb.key
    a.extend(llm_batch(3, 8))
    b.extend(llm_batch(2, 8, uid_start=10))
    assert (len(a), len(b)) == (3, 2)
    c = trl_impls.RAW_RAY_LAZY_TENSOR.factory(8)
    assert len(c) == 0  # a new buffer, not a recycled one
    assert item_uids(b.read(torch.arange(2))) == [10, 11]
    assert cluster.get(host.held.remote()) == before + 3
    pid = cluster.get(host.pid.remote())
    assert pid != __import__("os").getpid()  # served from another process
    del a, b, c  # dropping the owner frees its buffer in the host
    gc.collect()  # whichever of them sat in a reference cycle
    assert cluster.get(host.held.remote(), timeout=60) == before
    with pytest.raises(AttributeError, match="serves only"):
        trl_impls.RAW_RAY_LAZY_TENSOR.factory(8)._rb.set_storage  # noqa: B018


def test_a_buffer_host_serves_the_contract_methods_only() -> None:
    from posttrain.adapters.ray.buffer import BufferHost

    host = BufferHost()
    host.create("a", RingBuffer, (4,))
    for method in ("__class__", "_buffers", "__reduce__", "capacity"):
        with pytest.raises(ValueError, match=rf"'{method}': a buffer host serves only"):
            host.call("a", method, ())
    assert host.call("a", "__len__", ()) == 0
    with pytest.raises(ValueError, match="'__getitem__': a buffer host serves only"):
        host.call("a", "__getitem__", (0,))  # TorchRL's name of read, for TorchRL's buffers
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from posttrain.adapters.ray.buffer import TORCHRL_METHODS

    host.create("t", TensorDictReplayBuffer, (), {"storage": LazyTensorStorage(4)}, TORCHRL_METHODS)
    for method in ("_getattr", "set_storage", "read", "__reduce__"):
        with pytest.raises(ValueError, match=rf"'{method}': a buffer host serves only"):
            host.call("t", method, ())
    assert host.call("t", "__len__", ()) == 0
    with pytest.raises(ValueError, match="SERVED_METHODS or TORCHRL_METHODS"):
        host.create("u", RingBuffer, (4,), None, frozenset({"extend", "__class__"}))


def test_the_local_cluster_listens_on_loopback_only() -> None:
    import psutil

    from posttrain.adapters.ray.implementations import shared_host

    remote = serve_buffer(RingBuffer, 4)
    shared = trl_impls.RAW_RAY_LAZY_TENSOR.factory(4)  # in the rows' shared host actor
    try:
        assert len(remote) == 0  # a worker process is up and serving
        assert len(shared) == 0
        assert ray_get(shared_host().pid.remote(), 60) != remote.pid
        # Ray's own servers run in the processes it spawned (GCS, raylet, agents, workers); the
        # driver also holds whatever else the test process opened (TorchRL's gloo store in the
        # Ray repros listens on all interfaces: docs/reliability.md says so).
        pids = {p.pid for p in psutil.Process().children(recursive=True)}
        listening = [
            (c.pid, c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
        ]
    finally:
        remote.close()
    assert len(listening) >= 3, listening  # GCS, raylet, object manager, the worker
    exposed = [
        (" ".join(psutil.Process(pid).cmdline())[:80], ip, port)
        for pid, ip, port in listening
        if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")
    ]
    assert not exposed, f"listening beyond loopback (process, address, port): {exposed}"
