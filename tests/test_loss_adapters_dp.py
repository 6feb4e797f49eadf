"""The loss adapters under micro-batching and 2 and 4 data-parallel ranks.

Each adapted loss row that declares ``global_counts`` (NeMo-RL's loss both ways, TorchRL's
GRPO/DAPO/CISPO through ``ContractLoss``) is built as the conformance kit builds it, on the
tiny Llama, and called on micro-batches and on ranks' shards with the whole batch's
``GlobalCounts``; ranks are real ``torch.distributed`` gloo processes on loopback that
all-reduce the counts, then the loss values and gradients by sum. Both must equal the whole
batch in one call within the spec's float32 tolerance (LOSS-017: 1e-5 of the largest entry).
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts
from posttrain.contracts.implementation import Implementation
from posttrain.testing import llm_batch, tiny_causal_lm

K = LLM_LAYOUT_V1.key
V, PROMPT = 64, 3
ANSWERS = (3, 8, 6, 1, 0, 5)  # assistant tokens per row; row 4 has none
TOL = 1e-5
SPLITS = (((0, 1), (2, 3), (4, 5)), ((0,), (1, 2, 3, 4, 5)), ((3, 0, 5), (4,), (1, 2)))
SHARDS = {2: ((0, 2, 4), (1, 3, 5)), 4: ((0, 5), (1,), (2, 3), (4,))}


def _rows() -> dict[str, Implementation]:
    """Every adapted loss row with capability global_counts, by a short name."""
    import posttrain.adapters.nemo_rl.implementations as nemo
    import posttrain.adapters.torchrl.implementations as trl

    rows = {}
    for prefix, module in (("nemo_rl", nemo), ("torchrl", trl)):
        for name, impl in vars(module).items():
            if (
                isinstance(impl, Implementation)
                and impl.contract == "loss"
                and not name.startswith("RAW_")
                and "global_counts" in impl.capabilities
            ):
                rows[f"{prefix}:{name}"] = impl
    return rows


def _batch(policy: Any) -> TensorDictBase:
    """The rows of ANSWERS, off-policy (ratios around 1, some clipped), advantages of both
    signs; the answers start after a 3-token prompt."""
    b, t = len(ANSWERS), PROMPT + max(ANSWERS) + 1
    td = llm_batch(b, t, vocab_size=V, seed=3)
    pos = torch.arange(t).expand(b, t)
    lengths = torch.tensor(ANSWERS)
    att = pos < PROMPT + lengths[:, None]
    td.set(K("attention_mask"), att)
    asst = (pos >= PROMPT) & att
    td.set(K("assistant_mask"), asst)
    with torch.no_grad():
        logits = policy(input_ids=td.get(K("tokens")), attention_mask=att.long()).logits
    own = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, td.get(K("tokens"))[:, 1:, None])
    own = torch.cat([torch.zeros(b, 1), own[..., 0]], 1)
    g = torch.Generator().manual_seed(5)
    slp = own + 0.3 * torch.randn(b, t, generator=g)
    td.set(K("sample_log_probs"), torch.where(asst, slp, float("nan")))
    td.set(K("ref_log_probs"), torch.where(asst, own - 0.2, float("nan")))
    td.set(K("advantage"), torch.tensor([1.0, -0.5, 0.8, -1.2, 0.7, 0.4]))
    return td


def _trimmed(td: TensorDictBase) -> TensorDictBase:
    """A micro-batch padded to its own longest row, as loaders pad it."""
    n = max(int(td.get(K("attention_mask")).sum(-1).max()), 2)
    return td[:, :n] if td.batch_dims == 2 else td.apply(lambda v: v[:, :n] if v.ndim == 2 else v)


def _step(
    impl: Implementation, policy: Any, td: TensorDictBase, counts: GlobalCounts | None
) -> tuple[float, torch.Tensor]:
    """The summed ``loss_*`` terms and their parameter gradient (flat, float64)."""
    loss = impl.factory(policy, **impl.options)
    out = loss(td) if counts is None else loss(td, counts=counts)
    items = out.items() if hasattr(out, "items") else []
    total = sum(v for k, v in items if str(k).startswith("loss_"))
    params = list(policy.parameters())
    grads: tuple[torch.Tensor | None, ...] = (None,) * len(params)
    if isinstance(total, torch.Tensor) and total.requires_grad:
        # A micro-batch without assistant tokens may give a constant (TorchRL's does).
        grads = torch.autograd.grad(total, params, allow_unused=True)
    flat = [
        (g if g is not None else torch.zeros_like(p)).double().flatten()
        for g, p in zip(grads, params, strict=True)
    ]
    return float(total), torch.cat(flat)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def full() -> dict[str, tuple[float, torch.Tensor]]:
    policy = tiny_causal_lm(vocab_size=V, seed=0)
    td = _batch(policy)
    return {name: _step(impl, policy, td, None) for name, impl in _rows().items()}


def test_every_adapter_row_is_covered() -> None:
    names = set(_rows())
    assert {"nemo_rl:LOSS_TOKEN_MEAN", "nemo_rl:LOSS_SEQ_MEAN_TOKEN_MEAN"} <= names
    assert sum(n.startswith("torchrl:") for n in names) >= 7


@pytest.mark.parametrize("row", sorted(_rows()))
def test_micro_batches_of_an_adapter_add_up(
    full: dict[str, tuple[float, torch.Tensor]], row: str
) -> None:
    impl = _rows()[row]
    policy = tiny_causal_lm(vocab_size=V, seed=0)
    td = _batch(policy)
    counts = GlobalCounts.of(td)
    assert counts == GlobalCounts(tokens=sum(ANSWERS), sequences=5)
    value, grad = full[row]
    for split in SPLITS:
        parts = [_step(impl, policy, _trimmed(td[list(p)]), counts) for p in split]
        got = sum(v for v, _ in parts)
        assert abs(got - value) <= TOL * max(abs(value), 1.0), (split, got, value)
        assert _rel(torch.stack([g for _, g in parts]).sum(0), grad) <= TOL, split


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One data-parallel rank: its shard of the batch, every adapter row."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        policy = tiny_causal_lm(vocab_size=V, seed=0)
        shard = _trimmed(_batch(policy)[list(SHARDS[world][rank])])
        local = GlobalCounts.of(shard)
        both = torch.tensor([local.tokens, local.sequences], dtype=torch.int64)
        dist.all_reduce(both)
        counts = GlobalCounts(tokens=int(both[0]), sequences=int(both[1]))
        results: dict[str, Any] = {}
        for name, impl in _rows().items():
            value, grad = _step(impl, policy, shard, counts)
            pair = torch.cat([torch.tensor([value], dtype=torch.float64), grad])
            dist.all_reduce(pair)
            results[name] = (float(pair[0]), pair[1:].clone())
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_adapters_on_data_parallel_ranks_equal_one_batch(
    full: dict[str, tuple[float, torch.Tensor]], world: int, tmp_path: Path
) -> None:
    out = str(tmp_path / "ranks.pt")
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0] * world
    got = torch.load(out, weights_only=True)
    assert set(got) == set(full)
    for name, (value, grad) in got.items():
        want_value, want_grad = full[name]
        assert abs(value - want_value) <= TOL * max(abs(want_value), 1.0), name
        assert _rel(grad, want_grad) <= TOL, name
