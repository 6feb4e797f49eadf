"""The generation-server suite: one check per GEN requirement (specs/generation-v1.md).

The suite supplies a tiny real HF causal LM. Expected answers come from the same model run
alone, greedily, on one prompt at a time; new weights are seen through weights that force one
token. Every wait has a timeout, so a hanging server fails instead of stalling the run.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before 3.11
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.policy import forced_token_weights, tiny_causal_lm
from posttrain.conformance.registry import requirement
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY

V = 64
MAX_NEW = 3
FORCED = 42
WAIT = 60.0
REFUSE_WAIT = 10.0  # a request after shutdown: an answer this late counts as a hang
SHUTDOWN_GRACE = 10.0  # shutdown(5.0) must return within 5 s plus this
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [20, 21], [30, 31, 32], [40, 41], [50]]


def _fail(msg: str) -> ConformanceError:
    return ConformanceError(msg)


def _request(prompt: list[int]) -> TensorDict:
    return TensorDict({PROMPT_KEY: torch.tensor(prompt, dtype=torch.int64)}, batch_size=[])


@contextmanager
def _server(ctx: Context) -> Iterator[tuple[Any, Any]]:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    try:
        yield policy, server
    finally:
        t = threading.Thread(target=server.shutdown, daemon=True)
        t.start()
        t.join(5.0 + SHUTDOWN_GRACE)


def _alone(policy: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy answer and its log-probs, the model alone on this one prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = policy.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=policy.config.eos_token_id,
        )
        resp = out[0, len(prompt) :].tolist()
        if policy.config.eos_token_id in resp:
            resp = resp[: resp.index(policy.config.eos_token_id) + 1]
        full = torch.tensor([[*prompt, *resp]])
        lp = policy(input_ids=full).logits[0, :-1].float().log_softmax(-1)
        lps = lp[len(prompt) - 1 :].gather(-1, full[0, len(prompt) :, None])[:, 0]
    return resp, lps


def _result(future: Any, what: str, wait: float = WAIT) -> TensorDictBase:
    try:
        out: TensorDictBase = future.result(timeout=wait)
    except (TimeoutError, FuturesTimeout):
        raise _fail(f"{what}: no response within {wait:.0f} s") from None
    return out


def _check_layout(out: Any, what: str) -> None:
    if not isinstance(out, TensorDictBase):
        raise _fail(f"{what}: response is {type(out).__name__}, expected a TensorDict")
    toks = out.get(RESPONSE_KEY, None)
    lps = out.get(RESPONSE_LOG_PROBS_KEY, None)
    ver = out.get("policy_version", None)
    if toks is None or lps is None or ver is None:
        missing = [
            k
            for k, v in (
                (RESPONSE_KEY, toks),
                (RESPONSE_LOG_PROBS_KEY, lps),
                ("policy_version", ver),
            )
            if v is None
        ]
        raise _fail(f"{what}: response lacks {missing}")
    if toks.dtype != torch.int64 or toks.ndim != 1 or not 1 <= toks.numel() <= MAX_NEW:
        raise _fail(
            f"{what}: {RESPONSE_KEY!r} is {toks.dtype} {list(toks.shape)}, expected int64 [1..{MAX_NEW}]"
        )
    if lps.dtype != torch.float32 or lps.shape != toks.shape:
        raise _fail(
            f"{what}: {RESPONSE_LOG_PROBS_KEY!r} is {lps.dtype} {list(lps.shape)}, expected float32 {list(toks.shape)}"
        )
    if ver.dtype != torch.int64 or ver.ndim != 0:
        raise _fail(f"{what}: policy_version is {ver.dtype} {list(ver.shape)}, expected int64 []")


@requirement("GEN-001")
def response_layout(ctx: Context) -> None:
    with _server(ctx) as (policy, server):
        eos = policy.config.eos_token_id
        for p in PROMPTS:
            out = _result(server.client().submit(_request(p)), f"prompt {p}")
            _check_layout(out, f"prompt {p}")
            toks = out.get(RESPONSE_KEY).tolist()
            if eos in toks[:-1]:
                raise _fail(f"prompt {p}: response {toks} goes on after EOS ({eos})")
    # A policy that answers EOS at once: the response is that one token.
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    policy.load_state_dict(forced_token_weights(policy, policy.config.eos_token_id))
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    try:
        toks = _result(server.client().submit(_request(PROMPTS[0])), "EOS first").get(RESPONSE_KEY)
        if toks.tolist() != [policy.config.eos_token_id]:
            raise _fail(
                f"a policy that emits EOS first got response {toks.tolist()}, expected only EOS"
            )
    finally:
        t = threading.Thread(target=server.shutdown, daemon=True)
        t.start()
        t.join(5.0 + SHUTDOWN_GRACE)


@requirement("GEN-002")
def own_response(ctx: Context) -> None:
    with _server(ctx) as (policy, server):
        alone = {tuple(p): _alone(policy, p) for p in PROMPTS}
        want = {k: v[0] for k, v in alone.items()}
        got: dict[tuple[int, ...], list[int]] = {}
        errors: list[str] = []
        barrier = threading.Barrier(len(PROMPTS))

        def caller(prompt: list[int]) -> None:
            client = server.client()
            try:
                barrier.wait(timeout=WAIT)
                for _ in range(3):
                    out = _result(client.submit(_request(prompt)), f"prompt {prompt}")
                    got[tuple(prompt)] = out.get(RESPONSE_KEY).tolist()
                    lps = out.get(RESPONSE_LOG_PROBS_KEY)
                    own = alone[tuple(prompt)][1]
                    # Tokens and log-probs: two prompts may share a greedy answer, not its scores.
                    mismatch = lps.shape != own.shape or float((lps - own).abs().max()) > 1e-4
                    if got[tuple(prompt)] != want[tuple(prompt)] or mismatch:
                        errors.append(
                            f"prompt {prompt} got {got[tuple(prompt)]}, its own answer is {want[tuple(prompt)]}"
                        )
            except Exception as e:
                errors.append(f"prompt {prompt}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=caller, args=(p,), daemon=True) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        if errors:
            raise _fail(f"{len(PROMPTS)} concurrent callers: " + "; ".join(errors[:3]))
        if len(got) != len(PROMPTS):
            raise _fail(f"only {len(got)} of {len(PROMPTS)} concurrent callers were answered")


@requirement("GEN-003")
def batching_does_not_change_results(ctx: Context) -> None:
    with _server(ctx) as (_policy, server):
        client = server.client()
        alone = {tuple(p): _result(client.submit(_request(p)), f"{p} alone") for p in PROMPTS}
        burst = [(p, server.client().submit(_request(p))) for p in PROMPTS * 4]  # batched
        for p, f in burst:
            got, want = _result(f, f"{p} in a burst"), alone[tuple(p)]
            if got.get(RESPONSE_KEY).tolist() != want.get(RESPONSE_KEY).tolist():
                raise _fail(
                    f"prompt {p}: alone {want.get(RESPONSE_KEY).tolist()}, among others "
                    f"{got.get(RESPONSE_KEY).tolist()}"
                )
            diff = (got.get(RESPONSE_LOG_PROBS_KEY) - want.get(RESPONSE_LOG_PROBS_KEY)).abs().max()
            if diff > 1e-4:
                raise _fail(
                    f"prompt {p}: log-probs alone and among others differ by {float(diff):.2e}"
                )


@requirement("GEN-004")
def behaviour_log_probs(ctx: Context) -> None:
    with _server(ctx) as (policy, server):
        for p in PROMPTS[:3]:
            out = _result(server.client().submit(_request(p)), f"prompt {p}")
            toks = out.get(RESPONSE_KEY)
            full = torch.tensor([[*p, *toks.tolist()]])
            with torch.no_grad():
                lp = policy(input_ids=full).logits[0, :-1].float().log_softmax(-1)
            want = lp[len(p) - 1 :].gather(-1, full[0, len(p) :, None])[:, 0]
            diff = (out.get(RESPONSE_LOG_PROBS_KEY) - want).abs().max()
            if diff > 1e-4:
                raise _fail(
                    f"prompt {p}: response log-probs differ from the model's by {float(diff):.2e}"
                )


@requirement("GEN-005")
def version_stamped(ctx: Context) -> None:
    with _server(ctx) as (_policy, server):
        v0 = int(server.policy_version)
        out = _result(server.client().submit(_request(PROMPTS[0])), "before update")
        if int(out.get("policy_version")) != v0:
            raise _fail(f"response stamped {int(out.get('policy_version'))}, server version {v0}")
        server.update_policy_weights_(None)
        v1 = int(server.policy_version)
        if v1 <= v0:
            raise _fail(f"policy_version went from {v0} to {v1} after an update")
        out = _result(server.client().submit(_request(PROMPTS[0])), "after update")
        if int(out.get("policy_version")) != v1:
            raise _fail(
                f"response after the update stamped {int(out.get('policy_version'))}, expected {v1}"
            )


@requirement("GEN-006")
def new_weights_used(ctx: Context) -> None:
    with _server(ctx) as (policy, server):
        client = server.client()
        # Keep requests in flight while the update lands: none submitted after it may be stale.
        early = [client.submit(_request(p)) for p in PROMPTS]
        server.update_policy_weights_(forced_token_weights(policy, FORCED))
        late = [server.client().submit(_request(p)) for p in PROMPTS]
        v1 = int(server.policy_version)
        for f in early:
            out = _result(f, "in flight during the update")
            forced = out.get(RESPONSE_KEY).tolist()[0] == FORCED
            if forced != (int(out.get("policy_version")) == v1):
                raise _fail(
                    f"a request in flight during the update was answered "
                    f"{'with' if forced else 'without'} the new weights but stamped version "
                    f"{int(out.get('policy_version'))} (new version {v1})"
                )
        for p, f in zip(PROMPTS, late, strict=True):
            toks = _result(f, "after the update").get(RESPONSE_KEY).tolist()
            if toks[0] != FORCED:
                raise _fail(
                    f"prompt {p} submitted after update_policy_weights_ returned: answer {toks}, "
                    f"the new weights force {FORCED} first (stale weights served)"
                )


@requirement("GEN-007")
def bad_request_isolated(ctx: Context) -> None:
    with _server(ctx) as (policy, server):
        bad_key = TensorDict({("tokens", "prompts"): torch.tensor([5, 6])}, batch_size=[])
        bad_dtype = TensorDict({PROMPT_KEY: torch.tensor([5.0, 6.0])}, batch_size=[])
        good_before = server.client().submit(_request(PROMPTS[0]))
        futures = {
            "missing key": server.client().submit(bad_key),
            "float prompt": server.client().submit(bad_dtype),
        }
        good_with = server.client().submit(_request(PROMPTS[1]))
        for what, f in futures.items():
            try:
                f.result(timeout=REFUSE_WAIT)
            except (TimeoutError, FuturesTimeout):
                raise _fail(f"{what}: the bad request's future never resolved") from None
            except Exception as e:
                if repr(PROMPT_KEY) not in str(e) and "tokens.prompt" not in str(e):
                    raise _fail(
                        f"{what}: failed without naming the key {PROMPT_KEY!r}: {e}"
                    ) from None
            else:
                raise _fail(f"{what}: the bad request was answered instead of failing")
        for p, f in ((PROMPTS[0], good_before), (PROMPTS[1], good_with)):
            out = _result(f, f"valid request {p} next to bad ones", REFUSE_WAIT)
            _check_layout(out, f"valid request {p}")
            if out.get(RESPONSE_KEY).tolist() != _alone(policy, p)[0]:
                raise _fail(f"valid request {p} next to bad ones got another answer")
        later = _result(
            server.client().submit(_request(PROMPTS[2])), "a request after the bad ones"
        )
        if later.get(RESPONSE_KEY).tolist() != _alone(policy, PROMPTS[2])[0]:
            raise _fail("after bad requests the server answers wrongly")


@requirement("GEN-008")
def shutdown_resolves_everything(ctx: Context) -> None:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    futures = [server.client().submit(_request(p)) for p in PROMPTS * 4]
    done = threading.Event()

    def stop() -> None:
        server.shutdown(5.0)
        server.shutdown(5.0)  # idempotent
        done.set()

    t = threading.Thread(target=stop, daemon=True)
    start = time.perf_counter()
    t.start()
    t.join(5.0 + SHUTDOWN_GRACE)
    if not done.is_set():
        raise _fail(
            f"shutdown(5.0) with {len(futures)} pending requests has not returned after "
            f"{5.0 + SHUTDOWN_GRACE:.0f} s (hangs)"
        )
    elapsed = time.perf_counter() - start
    pending = [f for f in futures if not f.done()]
    if pending:
        raise _fail(
            f"after shutdown returned ({elapsed:.1f} s), {len(pending)} futures are still pending"
        )
    mode = ctx.options.get("on_shutdown", "fail")
    served = sum(1 for f in futures if f.exception() is None)
    if mode == "drain" and served != len(futures):
        raise _fail(
            f"on_shutdown='drain' declared, but {len(futures) - served} pending requests failed"
        )


@requirement("GEN-009")
def closed_server_refuses(ctx: Context) -> None:
    with _server(ctx) as (_policy, server):
        server.shutdown(5.0)
        outcome: list[str] = []

        def attempt() -> None:
            try:
                server.client().submit(_request(PROMPTS[0])).result(timeout=REFUSE_WAIT)
                outcome.append("answered")
            except (TimeoutError, FuturesTimeout):
                outcome.append("hung")
            except Exception:
                outcome.append("refused")

        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(REFUSE_WAIT + 5)
        if outcome != ["refused"]:
            raise _fail(
                f"a request after shutdown(): {outcome[0] if outcome else 'hung'}, expected a clear error"
            )


@requirement("GEN-010")
def statistics(ctx: Context) -> None:
    with _server(ctx) as (_policy, server):
        for f in [server.client().submit(_request(p)) for p in PROMPTS]:
            _result(f, "serving")
        stats = dict(server.stats())
        if not isinstance(stats.get("batch_size"), int | float) or stats["batch_size"] < 1:
            raise _fail(
                f"stats()['batch_size'] is {stats.get('batch_size')!r} after serving 8 requests"
            )
        for key in ("queue_wait_s", "batch_size", "forward_s"):
            v = stats.get(key)
            if not isinstance(v, int | float) or not v >= 0 or v != v or v == float("inf"):
                raise _fail(
                    f"stats()[{key!r}] is {v!r}; expected a finite number >= 0 (found keys {sorted(stats)})"
                )


def _remote_caller(client: Any, prompt: list[int], out: Any) -> None:  # pragma: no cover - child
    try:
        res = client.submit(_request(prompt)).result(timeout=WAIT)
        out.put((prompt, res.get(RESPONSE_KEY).tolist()))
    except Exception as e:
        out.put((prompt, f"{type(e).__name__}: {e}"))


@requirement("GEN-011")
def clients_in_other_processes(ctx: Context) -> None:
    if "processes" not in ctx.capabilities:
        raise NotApplicable("capability 'processes' not declared")
    with _server(ctx) as (policy, server):
        spawn = mp.get_context("spawn")
        queue = spawn.Queue()
        procs = [
            spawn.Process(target=_remote_caller, args=(server.client(), p, queue))
            for p in PROMPTS[:3]
        ]
        for pr in procs:
            pr.start()
        items = [queue.get(timeout=WAIT) for _ in procs]
        got = {tuple(p): v for p, v in items}
        for pr in procs:
            pr.join(WAIT)
        for p in PROMPTS[:3]:
            if got.get(tuple(p)) != _alone(policy, p)[0]:
                raise _fail(f"a client in another process asked {p} and got {got.get(tuple(p))!r}")
