"""NeMo-RL's GenerationInterface over generation servers."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.adapters.nemo_rl.generation import NemoGeneration
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY
from posttrain.reference_impls import ThreadGenerationServer
from posttrain.testing import tiny_causal_lm

PAD = 0


class CannedServer:
    """Answers fixed replies per prompt: the layout vector of NeMo-RL's own test."""

    def __init__(self, replies: dict[tuple[int, ...], tuple[list[int], list[float]]]) -> None:
        self.replies = replies
        self.closed = 0

    def client(self) -> Any:
        return self

    def submit(self, request: TensorDictBase) -> Future[TensorDictBase]:
        toks, lps = self.replies[tuple(request.get(PROMPT_KEY).tolist())]
        f: Future[TensorDictBase] = Future()
        f.set_result(
            TensorDict(
                {
                    RESPONSE_KEY: torch.tensor(toks, dtype=torch.int64),
                    RESPONSE_LOG_PROBS_KEY: torch.tensor(lps),
                    "policy_version": torch.tensor(0),
                },
                [],
            )
        )
        return f

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self.closed += 1


def test_vector_of_nemo_rls_megatron_generation_parse_test() -> None:
    # tests/unit/models/generation/test_megatron_generation_parse.py at 7ea279a.
    server = CannedServer({(5, 6, 7): ([11, 12], [-0.1, -0.2]), (8, 9): ([13], [-0.3])})
    out = NemoGeneration(server).generate(
        {
            "input_ids": torch.tensor([[5, 6, 7, PAD], [8, 9, PAD, PAD]], dtype=torch.long),
            "input_lengths": torch.tensor([3, 2], dtype=torch.long),
        },
        greedy=True,
    )
    assert out["output_ids"].tolist() == [[5, 6, 7, 11, 12, PAD], [8, 9, 13, PAD, PAD, PAD]]
    assert out["generation_lengths"].tolist() == [2, 1]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 3]
    want = torch.zeros(2, 6)
    want[0, 3:5] = torch.tensor([-0.1, -0.2])
    want[1, 2:3] = torch.tensor([-0.3])
    torch.testing.assert_close(out["logprobs"], want)
    assert out["generation_lengths"].dtype == out["unpadded_sequence_lengths"].dtype == torch.long


def test_over_the_reference_server_and_its_refusals() -> None:
    policy = tiny_causal_lm()
    gen = NemoGeneration(ThreadGenerationServer(policy, max_new_tokens=3))
    out = gen.generate(
        {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "input_lengths": torch.tensor([3, 2])},
        greedy=True,
    )
    for i, n in enumerate([3, 2]):
        total = int(out["unpadded_sequence_lengths"][i])
        resp = out["output_ids"][i, n:total]
        full = out["output_ids"][i, :total][None]
        with torch.no_grad():
            lp = policy(input_ids=full).logits[0, :-1].log_softmax(-1)
        want = lp[n - 1 :].gather(-1, resp[:, None])[:, 0]
        torch.testing.assert_close(out["logprobs"][i, n:total], want, atol=1e-5, rtol=1e-5)
        assert (out["logprobs"][i, :n] == 0).all()
    with pytest.raises(ValueError, match=r"rows \[1\] are not right-padded"):
        gen.generate(
            {"input_ids": torch.tensor([[5, 6], [8, 4]]), "input_lengths": torch.tensor([2, 1])},
            greedy=True,
        )
    with pytest.raises(ValueError, match="greedy=False"):
        gen.generate({"input_ids": torch.tensor([[5]]), "input_lengths": torch.tensor([1])})
    assert gen.prepare_for_generation()
    assert gen.finish_generation()
    assert gen.shutdown()
    assert gen.shutdown()
