"""Static conformance of the loss, metrics, rollout and weight-sync Protocols."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.objectives.llm import GRPOLoss
from torchrl.record.loggers.csv import CSVLogger

from posttrain.contracts import (
    LossModuleV1,
    MetricSinkV1,
    RolloutSourceV1,
    WeightReceiverV1,
    WeightSenderV1,
)


def takes_loss(loss: GRPOLoss) -> LossModuleV1:
    return loss  # an nn.Module called on a TensorDict conforms


def takes_logger(logger: CSVLogger) -> MetricSinkV1:
    return logger  # TorchRL's loggers conform natively


class Source:
    def __iter__(self) -> Iterator[TensorDictBase]:
        return iter(())

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        pass

    @property
    def policy_version(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


class SourceWithoutVersion:
    def __iter__(self) -> Iterator[TensorDictBase]:
        return iter(())

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Sender:
    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        pass


class SenderWithoutVersion:
    def send(self, weights: Any = None) -> None:  # TorchRL's scheme signature
        pass


class Receiver:
    def receive(self, timeout: float | None = None) -> None:
        pass

    @property
    def version(self) -> int:
        return 0


source: RolloutSourceV1 = Source()
no_version: RolloutSourceV1 = SourceWithoutVersion()  # type: ignore[assignment]
sender: WeightSenderV1 = Sender()
torchrl_style_sender: WeightSenderV1 = SenderWithoutVersion()  # type: ignore[assignment]
receiver: WeightReceiverV1 = Receiver()
not_a_receiver: WeightReceiverV1 = Sender()  # type: ignore[assignment]
not_a_sink: MetricSinkV1 = Sender()  # type: ignore[assignment]
