"""A hosted TorchRL buffer whose ``RayReplayBuffer`` fails after the host built it, or whose
create times out, is dropped from the host (TorchRL's own cleanup can only ``ray.kill`` an
actor). No Ray cluster: the
host, the cluster join and TorchRL's class are stand-ins."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchrl")

import torchrl.data

from posttrain.adapters.ray import hosted


class _Remote:
    def __init__(self, log: list[tuple[str, Any]], name: str) -> None:
        self.log, self.name = log, name

    def remote(self, *args: Any, **_: Any) -> tuple[str, Any]:
        self.log.append((self.name, args[0]))
        return (self.name, args[0])


class _Host:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.create, self.drop = _Remote(self.log, "create"), _Remote(self.log, "drop")


class _FailingRayReplayBuffer:
    def __init__(self, replay_buffer_cls: Any, **_: Any) -> None:
        replay_buffer_cls.as_remote(None).remote()
        raise RuntimeError("client start failed")


def test_a_failed_client_drops_the_buffer_built_in_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = _Host()
    monkeypatch.setattr(hosted, "ensure_cluster", lambda: None)
    monkeypatch.setattr(hosted, "ray_get", lambda ref, timeout: None)
    monkeypatch.setattr(torchrl.data, "RayReplayBuffer", _FailingRayReplayBuffer)
    with pytest.raises(RuntimeError, match="client start failed"):
        hosted.hosted_torchrl_buffer(object, host)
    (created, key), dropped = host.log[0], host.log[1:]
    assert created == "create"
    assert dropped == [("drop", key)]


def test_a_create_that_times_out_is_followed_by_a_drop_of_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = _Host()
    monkeypatch.setattr(hosted, "ensure_cluster", lambda: None)

    def times_out(ref: Any, timeout: Any) -> None:
        raise TimeoutError("no answer in 30 s")

    monkeypatch.setattr(hosted, "ray_get", times_out)
    with pytest.raises(TimeoutError):
        hosted.hosted_torchrl_buffer(object, host)
    (created, key), dropped = host.log[0], host.log[1:]
    assert created == "create"
    assert dropped == [("drop", key)]
