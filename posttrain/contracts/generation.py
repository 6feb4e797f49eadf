"""Contract ``generation`` v1: a push-style generation server (request in, response out).

The twin of the pull-style ``rollout`` contract: many callers submit single requests, the server
batches them, generates, and answers each caller with its own response, stamped with the
weights version that produced it. TorchRL's ``InferenceServer`` (``client().submit(td) ->
future``, ``update_policy_weights_``, ``stats()``, ``shutdown()``) has this shape.

Request: a TensorDict with batch size [] holding ``("tokens", "prompt")`` (int64 [P]).
Response: ``("tokens", "response")`` (int64 [R], R <= max_new_tokens, EOS included when
generated), ``("log_probs", "response")`` (float32 [R], log p of each response token under the
serving weights) and ``policy_version`` (int64 []).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from posttrain.contracts.contract import Capability, Contract, Option
from posttrain.contracts.requirements import Level, Requirement

PROMPT_KEY = ("tokens", "prompt")
RESPONSE_KEY = ("tokens", "response")
RESPONSE_LOG_PROBS_KEY = ("log_probs", "response")


class GenerationClientV1(Protocol):
    """One caller's handle: submit a request, get a future of its response.

    Example:
        >>> def ask(client: GenerationClientV1, request):
        ...     return client.submit(request).result(timeout=30.0)
    """

    def submit(self, request: TensorDictBase, /) -> Any:
        """A ``concurrent.futures.Future``-like object: ``.result(timeout)`` gives the response
        or raises the request's own error."""
        ...


class GenerationServerV1(Protocol):
    """The server: hands out clients, takes new weights, reports statistics, shuts down.

    Example:
        >>> def refresh(server: GenerationServerV1, weights) -> int:
        ...     server.update_policy_weights_(weights)
        ...     return server.policy_version
    """

    def client(self) -> GenerationClientV1:
        """A new client handle (one per caller thread)."""
        ...

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> Any:
        """Load ``weights`` (``None``: re-read the policy's own); later requests use them."""
        ...

    @property
    def policy_version(self) -> int:
        """The version stamped on responses generated from now on."""
        ...

    def stats(self) -> Mapping[str, float]:
        """At least ``queue_wait_s``, ``batch_size`` and ``forward_s`` (means over served batches)."""
        ...

    def shutdown(self, timeout: float | None = 5.0) -> Any:
        """Stop serving within ``timeout``; pending requests drain or fail as declared."""
        ...


def request_problem(request: Any) -> str | None:
    """What is wrong with a generation request (naming the key), or ``None``.

    Example:
        >>> from tensordict import TensorDict
        >>> request_problem(TensorDict({("tokens", "prompt"): torch.tensor([5.0])}, []))
        "request: key ('tokens', 'prompt') expected int64 [P], found torch.float32 [1]"
    """
    if not isinstance(request, TensorDictBase):
        return f"request: expected a TensorDict, found {type(request).__name__}"
    prompt = request.get(PROMPT_KEY, None)
    if prompt is None:
        return f"request: key {PROMPT_KEY!r} is missing"
    if not isinstance(prompt, torch.Tensor) or prompt.dtype != torch.int64 or prompt.ndim != 1:
        found = (
            f"{prompt.dtype} {list(prompt.shape)}"
            if isinstance(prompt, torch.Tensor)
            else type(prompt).__name__
        )
        return f"request: key {PROMPT_KEY!r} expected int64 [P], found {found}"
    if prompt.numel() == 0:
        return f"request: key {PROMPT_KEY!r} is empty"
    return None


_M, _S = Level.MUST, Level.SHOULD

GENERATION = Contract(
    id="generation",
    version="1.5",
    title="Generation server",
    purpose=(
        "Serves generation requests pushed by many callers: batches them, generates with the "
        "current weights and answers every caller with exactly its own response, stamped with "
        "the weights version. A bad request fails its caller only; shutdown never hangs. A "
        "request belongs to the server from `submit` until its future resolves: what a caller "
        "that changes the request's tensors in that time gets is out of scope (a server may "
        "read the prompt when it batches it); once the future resolved, the caller may reuse "
        "them (GEN-002)."
    ),
    protocol=GenerationServerV1,
    extra_protocols=(GenerationClientV1,),
    factory=(
        "factory(policy, *, max_new_tokens: int) -> GenerationServerV1  # policy: an HF causal "
        "LM the suite supplies; greedy decoding"
    ),
    capabilities=(
        Capability(name="processes", text="Clients may live in other processes than the server.",
            undeclared="Clients are checked in the server's own process, from concurrent threads (GEN-002); GEN-011 does not apply."),
    ),
    options=(
        Option(name="on_shutdown", values=("drain", "fail"), default="fail", text="What `shutdown` does with requests still pending: serve them, or fail their futures (an exception set, or the future cancelled as `ThreadPoolExecutor.shutdown(cancel_futures=True)` does)."),
    ),
    requirements=(
        Requirement(id="GEN-001", level=_M, title="response layout",
            text="A response MUST hold `('tokens', 'response')` int64 [R] with 1 <= R <= max_new_tokens, `('log_probs', 'response')` float32 [R] and `policy_version` int64 []; a response that generated EOS MUST end with that EOS (nothing after it, so a policy whose first token is EOS answers `[EOS]`).", tightened=("1.3", "1.4"),
            domain="The suite's eight prompts (1 to 4 tokens) with `max_new_tokens=3`; servers built with `max_new_tokens` 1 and 5, each asked a one-token prompt, a three-token one, `[0]` (the pad id) and `[EOS, 63]`; then a policy whose first token is EOS. A valid request whose future fails (with any exception) fails this requirement, as it fails every requirement that submits one; so does one still pending max(10 s, 20 times as long as they took) after the requests submitted with it were answered (lost, not slow), or 60 s after its submit while none of them is."),
        Requirement(id="GEN-002", level=_M, title="own response",
            text="With many clients in concurrent threads submitting distinct prompts, every caller MUST receive the response to its own prompt, never another's (nor that of another request in flight on its own client), also after other callers cancelled their futures at any point of their requests' lives.", tightened=("1.1", "1.3", "1.4"), depends_on=("GEN-001",),
            domain="Eight clients in threads, three requests each; four clients with four requests in flight each behind a held batch; then any prompts (every token id of the 64-token vocabulary, the pad id 0, EOS and 63 included, 1 to 14 tokens; 1 to 6 prompts, the edge prompts first) submitted together on new clients, and one after another on one client that reuses its request and prompt tensor (a view at an offset into one storage) rewritten in place once answered; then a caller that cancels its future (where the handle has `cancel()`) right after submit, queued behind a held batch, while its own batch is held in flight, and after its answer, other callers' requests in flight then and submitted after each answered within 10 s."),
        Requirement(id="GEN-003", level=_M, title="batching does not change results",
            text="A request served alone and the same request served inside a batch MUST give the same tokens (greedy) and log-probs within 1e-4 (a response that ends at EOS ends there, whatever the other rows of its batch generate).", tightened=("1.1",), depends_on=("GEN-001",),
            domain="The suite's eight prompts served alone and four times over in one burst; a row ending at EOS batched with rows going on to `max_new_tokens`."),
        Requirement(id="GEN-004", level=_M, title="behaviour log-probs",
            text="`('log_probs', 'response')` MUST equal the serving weights' log-probs of the response tokens within 1e-4.", depends_on=("GEN-001",), tightened=("1.3",),
            domain="Three of the suite's prompts, then any prompt (every token id, pad and EOS included, 1 to 14 tokens; the edge prompts first)."),
        Requirement(id="GEN-005", level=_M, title="version stamped",
            text="Every response MUST carry the `policy_version` of the weights that produced it (all its tokens and log-probs, also for a batch in flight while an update arrives), and `policy_version` MUST rise with every update.", tightened=("1.1", "1.3", "1.4", "1.5"), depends_on=("GEN-001",),
            domain="An update before and after a request; an update while a batch is held in flight; the weights already served sent again; then random sequences (4, 10 steps, more with depth) of submits (any prompt, new or reused clients), updates (other weights, the same weights again, the policy changed in place and no argument) and answers awaited in any order, each response compared with the greedy answer of the weights its stamp names, each update's `policy_version` with the one before; updates from several threads at once (three rounds of 2, 4 and 3 threads released together, and a rule of the random sequences with 2 to 4), each with other weights or the same again, a request in flight before them and others submitted while they run: n overlapping updates MUST raise `policy_version` by at least n, each thread MUST read a version above the one before them once its own returned, a response stamped with a version they passed through MUST be the greedy answer of one of their weights (the same weights for every response of that stamp), and a request submitted once they all returned MUST be stamped with the version they left and served by one of their weights."),
        Requirement(id="GEN-006", level=_M, title="new weights used",
            text="After `update_policy_weights_` returns, every later request MUST be served by the new weights: its tokens and log-probs are theirs (given as an argument, or, with no argument, the policy's own as changed in place).", tightened=("1.1",), depends_on=("GEN-001",),
            domain="Every prompt served once, requests in flight during an update, then every prompt after `update_policy_weights_(weights)` and after the policy changed in place and `update_policy_weights_()`; GEN-005's random sequences also check each answer against its stamp's weights."),
        Requirement(id="GEN-007", level=_M, title="bad request isolated",
            text="A request with a missing key or a wrong dtype MUST fail its own future with an error naming the key, while concurrent and later valid requests are served.", depends_on=("GEN-001",), tightened=("1.3",),
            domain="A missing key and a float prompt next to valid requests; then any prompt as float32, float64, float16, bfloat16, int32, int16, uint8 or bool, or under another key (`('tokens', 'prompts')`, `'prompt'`, `('tokens', 'response')`, `'input_ids'`), each next to a valid request of the same tokens."),
        Requirement(id="GEN-008", level=_M, title="shutdown",
            text="`shutdown` MUST return within its timeout (`None`: as long as the pending requests take) with requests still pending, leave no pending future unresolved (each served or failed, as the `on_shutdown` option says; a cancelled future counts as failed; a batch in flight when a timeout shorter than it runs out may settle after `shutdown` returns, as `ThreadPoolExecutor`'s running tasks do), and be idempotent.", tightened=("1.2", "1.4"), depends_on=("GEN-001",),
            domain="32 requests pending at `shutdown(5.0)`, `shutdown(None)` and `shutdown(0)`, each called twice (under `on_shutdown='drain'` the first two serve every request; `shutdown(0)` need only resolve every one, a batch in flight settling at most 10 s after it returns; a future failed with a `TimeoutError` of its own counts as failed); under `on_shutdown='fail'` (the default), requests queued behind forwards held at a gate."),
        Requirement(id="GEN-009", level=_M, title="closed server refuses",
            text="A request submitted after `shutdown`, through any client (also one obtained before), MUST raise, or fail its future with a clear error or cancel it, instead of hanging.", tightened=("1.1",), depends_on=("GEN-008",),
            domain="A request after `shutdown` through a client taken (and used) before it and through a new client."),
        Requirement(id="GEN-010", level=_S, title="statistics",
            text="After serving, `stats()` SHOULD report finite, non-negative `queue_wait_s`, `batch_size` and `forward_s`.", depends_on=("GEN-001",),
            domain="`stats()` after eight requests served."),
        Requirement(id="GEN-011", level=_M, title="clients in other processes", capability="processes",
            text="Clients in other processes MUST each receive the response to their own prompt.", depends_on=("GEN-002",),
            domain="Three clients sent to spawned processes, one prompt each."),
    ),
)  # fmt: skip
