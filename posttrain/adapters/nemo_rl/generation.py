"""NeMo-RL's ``GenerationInterface`` over any ``GenerationServerV1``.

NeMo-RL (``nemo_rl/models/generation/interfaces.py``, commit 7ea279a) calls
``generate(data, greedy)`` with ``input_ids`` [B, S] right-padded with the tokenizer's pad id
and ``input_lengths`` [B]; it expects ``output_ids`` [B, S + longest generation] (each row: its
prompt, its generated tokens from the true prompt length on, then pad), ``logprobs`` aligned
with ``output_ids`` (position t: log p of token t) and 0 on prompt and padding,
``generation_lengths`` and ``unpadded_sequence_lengths`` (int64), as its vLLM and Megatron
workers build them (``vllm/vllm_worker.py``, ``megatron/megatron_worker.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from posttrain.adapters.nemo_rl.train_data import batched_data_dict
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY


class NemoGeneration:
    """``generate`` / ``prepare_for_generation`` / ``finish_generation`` / ``shutdown`` of
    NeMo-RL's ``GenerationInterface``, sending each row as one request to ``server``.

    Decoding is the server's (the reference and TorchRL rows of the generation contract are
    greedy): ``greedy=False`` is refused rather than silently ignored, unless the server was
    declared ``sampling=True``. Input padding is checked as NeMo-RL's
    ``verify_right_padding`` does. Weights reach the server through its own
    ``update_policy_weights_`` (or a ``NemoWeightSynchronizer``).

    Example:
        >>> import torch
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.reference_impls import ThreadGenerationServer
        >>> gen = NemoGeneration(ThreadGenerationServer(tiny_causal_lm(), max_new_tokens=2))
        >>> out = gen.generate({"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
        ...                     "input_lengths": torch.tensor([3, 2])}, greedy=True)
        >>> out["output_ids"].shape, out["unpadded_sequence_lengths"].tolist()
        (torch.Size([2, 5]), [5, 4])
        >>> gen.shutdown(), gen.shutdown()
        (True, True)
    """

    def __init__(
        self, server: Any, *, pad_token_id: int = 0, sampling: bool = False, timeout: float = 300.0
    ) -> None:
        self.server = server
        self.pad_token_id = pad_token_id
        self.sampling = sampling
        self.timeout = timeout
        self._closed = False

    def generate(self, data: Any, greedy: bool = False) -> Any:
        """NeMo-RL's ``generate``: one request per row, answers laid out as its workers do."""
        if not greedy and not self.sampling:
            raise ValueError(
                "greedy=False: this server decodes greedily; construct NemoGeneration(..., "
                "sampling=True) over a sampling server"
            )
        d = dict(getattr(data, "data", data))
        ids, lengths = d.get("input_ids"), d.get("input_lengths")
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            raise ValueError(f"'input_ids': expected a [B, S] tensor, found {type(ids).__name__}")
        if not isinstance(lengths, torch.Tensor) or lengths.shape != ids.shape[:1]:
            raise ValueError(
                f"'input_lengths': expected [{ids.shape[0]}], found {getattr(lengths, 'shape', lengths)}"
            )
        b, s = ids.shape
        beyond = torch.arange(s) >= lengths[:, None]
        if (ids[beyond] != self.pad_token_id).any():
            rows = sorted(set(beyond.nonzero()[:, 0][ids[beyond] != self.pad_token_id].tolist()))
            raise ValueError(
                f"'input_ids': rows {rows} are not right-padded with {self.pad_token_id}"
            )
        if b == 0:
            return batched_data_dict(
                {
                    "output_ids": torch.zeros((0, 0), dtype=torch.long),
                    "logprobs": torch.zeros((0, 0)),
                    "generation_lengths": torch.zeros(0, dtype=torch.long),
                    "unpadded_sequence_lengths": torch.zeros(0, dtype=torch.long),
                }
            )
        client = self.server.client()
        futures = [
            client.submit(TensorDict({PROMPT_KEY: ids[i, : int(lengths[i])].to(torch.int64)}, []))
            for i in range(b)
        ]
        answers = [f.result(timeout=self.timeout) for f in futures]
        gens = [a.get(RESPONSE_KEY) for a in answers]
        width = s + max(int(g.numel()) for g in gens)
        output_ids = torch.full((b, width), self.pad_token_id, dtype=ids.dtype)
        logprobs = torch.zeros(b, width, dtype=torch.float32)
        for i, (a, g) in enumerate(zip(answers, gens, strict=True)):
            n = int(lengths[i])
            output_ids[i, :n] = ids[i, :n]
            output_ids[i, n : n + g.numel()] = g.to(ids.dtype)
            logprobs[i, n : n + g.numel()] = a.get(RESPONSE_LOG_PROBS_KEY).float()
        gen_lengths = torch.tensor([g.numel() for g in gens], dtype=torch.long)
        return batched_data_dict(
            {
                "output_ids": output_ids,
                "logprobs": logprobs,
                "generation_lengths": gen_lengths,
                "unpadded_sequence_lengths": lengths.to(torch.long) + gen_lengths,
            }
        )

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to wake: the server is always serving."""
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to release."""
        return True

    def init_collective(self, *args: Any, **kwargs: Any) -> Any:
        """No collective: weights reach the server through its weight sync."""
        raise NotImplementedError(
            "weights reach the server through update_policy_weights_ / a WeightSyncV1"
        )

    def shutdown(self) -> bool:
        """Shut the server down; repeated calls are safe."""
        if not self._closed:
            self._closed = True
            self.server.shutdown()
        return True
