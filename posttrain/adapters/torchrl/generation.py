"""TorchRL's ``InferenceServer`` serving LLM generation, raw and adapted to ``GenerationServerV1``.

The server (``torchrl.modules.inference_server``, thread backend) batches single requests with
``lazy_stack``, calls a model on the batch, stamps ``policy_version`` and fans results back to
per-request futures. The model here is greedy HF generation over the batch's prompts
(:class:`GenerateBatch`); everything else is TorchRL's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain._futures import settle
from posttrain.adapters.torchrl.weight_sync import weight_problems, weight_signature
from posttrain.contracts.generation import (
    PROMPT_KEY,
    RESPONSE_KEY,
    RESPONSE_LOG_PROBS_KEY,
    request_problem,
)
from posttrain.errors import ServerClosed
from posttrain.reference_impls.generation_server import greedy_answers


class GenerateBatch(torch.nn.Module):
    """The served model: a batch of requests (a lazy stack) -> a lazy stack of responses,
    computed as the reference server computes them (``greedy_answers``).

    Example:
        >>> from tensordict import lazy_stack
        >>> from posttrain.testing import tiny_causal_lm
        >>> gen = GenerateBatch(tiny_causal_lm(), max_new_tokens=2)
        >>> prompts = [torch.tensor([5, 6, 7]), torch.tensor([8])]  # ragged: stacked lazily
        >>> out = gen(lazy_stack([TensorDict({("tokens", "prompt"): p}, []) for p in prompts]))
        >>> out.batch_size, out["tokens", "response"].shape, out["log_probs", "response"].dtype
        (torch.Size([2]), torch.Size([2, 2]), torch.float32)
    """

    def __init__(self, policy: Any, max_new_tokens: int) -> None:
        super().__init__()
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        cfg = policy.config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None

    @torch.no_grad()
    def forward(self, batch: TensorDictBase) -> TensorDictBase:
        """One response per request of ``batch``, as a lazy stack in request order."""
        items = batch.tensordicts if isinstance(batch, LazyStackedTensorDict) else batch.unbind(0)
        prompts = [x.get(PROMPT_KEY) for x in items]
        answers = [
            TensorDict({RESPONSE_KEY: tokens, RESPONSE_LOG_PROBS_KEY: lps}, [])
            for tokens, lps in greedy_answers(
                self.policy, prompts, self.max_new_tokens, pad=self.pad, eos=self.eos
            )
        ]
        return LazyStackedTensorDict.lazy_stack(answers, 0)


def _server(policy: Any, max_new_tokens: int, processes: bool) -> Any:
    with optional_deps():
        from torchrl.modules.inference_server import InferenceServer

    transport: Any = "auto"
    if processes:  # clients that can be handed to spawned processes
        with optional_deps():
            from torchrl.modules.inference_server._mp import MPTransport

        transport = MPTransport()
    server = InferenceServer(
        GenerateBatch(policy, max_new_tokens), transport=transport, max_batch_size=8, timeout=0.005
    )
    return server.start()


def inference_server(
    policy: Any, *, max_new_tokens: int = 4, adapted: bool = False, processes: bool = False
) -> Any:
    """TorchRL's thread ``InferenceServer`` generating with ``policy`` (raw or adapted).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> server = inference_server(tiny_causal_lm(), max_new_tokens=2, adapted=True)
        >>> out = server.client().submit(TensorDict({("tokens", "prompt"): torch.tensor([5, 6])}, [])).result(30)
        >>> out["tokens", "response"].shape
        torch.Size([2])
        >>> server.shutdown(); server.shutdown()
    """
    raw = _server(policy, max_new_tokens, processes)
    return ContractInferenceServer(raw, policy) if adapted else raw


class _Client:
    def __init__(self, owner: ContractInferenceServer) -> None:
        self.owner = owner
        self.inner = owner.server.client()

    def submit(self, request: TensorDictBase, /) -> Future[TensorDictBase]:
        return self.owner._submit(self.inner, request)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        # In another process: TorchRL's client (a multiprocessing transport's is picklable),
        # still refusing malformed requests before they reach anyone's batch.
        return _RemoteClient, (self.inner,)


class _RemoteClient:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def submit(self, request: TensorDictBase, /) -> Any:
        problem = request_problem(request)
        if problem:
            out: Future[TensorDictBase] = Future()
            out.set_exception(ValueError(problem))
            return out
        return self.inner.submit(request)


class ContractInferenceServer:
    """TorchRL's ``InferenceServer`` made to conform to ``GenerationServerV1`` (thin).

    - A malformed request fails its own future before it reaches the batch (TorchRL runs it
      with the batch, and the model's error fails every request of that batch).
    - ``update_policy_weights_(weights)`` checks names, shapes and dtypes, then loads them
      through ``server.update_model`` (under the server's model lock, version bumped).
      TorchRL's own ``update_policy_weights_(model_id, policy_or_weights)`` only records an
      update: weights reach it through a ``WeightSyncScheme``.
    - ``shutdown`` fails every request still pending (TorchRL leaves their futures unresolved)
      and is idempotent; a request after it fails at once.
    - ``stats()`` adds ``queue_wait_s``, ``batch_size``, ``forward_s`` (from TorchRL's p50
      milliseconds and average batch size).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> policy = tiny_causal_lm()
        >>> server = inference_server(policy, max_new_tokens=2, adapted=True)
        >>> server.client().submit(TensorDict({}, [])).exception()  # fails alone, not its batch
        ValueError("request: key ('tokens', 'prompt') is missing")
        >>> server.update_policy_weights_(policy.state_dict()); server.policy_version
        1
        >>> server.shutdown(); server.shutdown()
    """

    def __init__(self, server: Any, policy: Any) -> None:
        self.server = server
        self.policy = policy
        self._pending: set[Future[TensorDictBase]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def client(self) -> _Client:
        """A client whose ``submit`` validates, then forwards to TorchRL's client."""
        return _Client(self)

    @property
    def policy_version(self) -> int:
        """TorchRL's ``policy_version``."""
        return int(self.server.policy_version)

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        """Check, then load ``weights`` under TorchRL's model lock (``None``: just bump)."""
        if weights is None:
            self.server.update_model(lambda model: None)
            return
        problems = weight_problems(weight_signature(self.policy), weights)
        if problems:
            raise ValueError("weights rejected (server unchanged): " + "; ".join(problems))
        self.server.update_model(lambda model: model.policy.load_state_dict(dict(weights)))

    def stats(self) -> dict[str, float]:
        """TorchRL's statistics plus the contract's three, in seconds and items."""
        s = dict(self.server.stats())
        return s | {
            "queue_wait_s": float(s.get("p50_queue_ms", 0.0)) / 1000,
            "batch_size": float(s.get("avg_batch_size", 0.0)),
            "forward_s": float(s.get("p50_forward_ms", 0.0)) / 1000,
        }

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """TorchRL's shutdown, then every pending future fails; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.server.shutdown(timeout)
        with self._lock:
            pending, self._pending = self._pending, set()
        for fut in pending:
            settle(fut, error=ServerClosed("the server shut down before serving this request"))

    def _submit(self, inner: Any, request: TensorDictBase) -> Future[TensorDictBase]:
        out: Future[TensorDictBase] = Future()
        problem = request_problem(request)
        if problem:
            out.set_exception(ValueError(problem))
            return out
        with self._lock:  # shutdown() sees every future registered before its flag
            if self._closed:
                out.set_exception(
                    ServerClosed("submit after shutdown(): this server serves no more requests")
                )
                return out
            self._pending.add(out)
        inner_future = inner.submit(request)

        def relay(f: Any) -> None:
            try:
                result = f.result()
            except Exception as e:
                settle(out, error=e)
            else:
                settle(out, result=result)
            with self._lock:  # only now: until settled, shutdown() must be able to fail it
                self._pending.discard(out)

        add = getattr(inner_future, "add_done_callback", None)
        if callable(add):
            add(relay)
        else:  # TorchRL's multiprocessing transport answers with a future without callbacks
            threading.Thread(target=relay, args=(inner_future,), daemon=True).start()
        return out
