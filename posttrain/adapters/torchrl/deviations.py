"""TorchRL's deviations from the contracts, each with a minimal repro a maintainer can paste.

Each repro is plain TorchRL code ending in ``assert`` statements that hold *because of* the
deviation; ``tests/test_torchrl_buffers.py`` runs them, so a fix upstream shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEVIATIONS",
    "GENERATION_DEVIATIONS",
    "LOGGER_DEVIATIONS",
    "LOSS_DEVIATIONS",
    "RAY_DEVIATIONS",
    "ROLLOUT_DEVIATIONS",
    "WEIGHT_SYNC_DEVIATIONS",
    "Deviation",
]


@dataclass(frozen=True)
class Deviation:
    """One way a TorchRL component breaks a requirement, with its repro.

    Example:
        >>> DEVIATIONS[0].requirements
        ('BUF-009',)
    """

    requirements: tuple[str, ...]
    component: str
    title: str
    repro: str
    blocked_by: tuple[str, ...] = ()
    """Declared failures that block ``requirements`` in a full run of the row (run alone, they
    fail as the repro shows)."""


_HEAD = """import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
"""

DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("BUF-009",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage, LazyStackStorage",
        "extend accepts a batch with a stored key missing",
        _HEAD
        + """rb.extend(TensorDict({"a": torch.ones(2)}, batch_size=[2]))  # no "b": accepted
assert len(rb) == 4  # rows 2-3 of "b" hold whatever the storage had (uninitialised / zeros)
""",
    ),
    Deviation(
        ("BUF-010",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage, LazyStackStorage",
        "extend accepts a batch with a key the buffer does not store",
        _HEAD
        + """rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)}, batch_size=[2]))
assert len(rb) == 4  # "c" was accepted (LazyTensorStorage adds a column, LazyMemmapStorage drops it)
""",
    ),
    Deviation(
        ("BUF-011",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage",
        "a wrong dtype fails half-way: the error names no key and the write position still advances",
        _HEAD
        + """try:
    rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.float64)}, batch_size=[2]))
except RuntimeError as e:
    assert "'b'" not in str(e)  # "Index put requires the source and destination dtypes match"
else:
    raise SystemExit("accepted: a different deviation")
assert len(rb) == 4  # the failed write counts: two rows of garbage are now sampleable
""",
    ),
    Deviation(
        ("BUF-012",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage",
        "a wrong item shape fails half-way: the error names no key and the write position still advances",
        _HEAD
        + """try:
    rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2, 3)}, batch_size=[2]))
except RuntimeError as e:
    assert "'b'" not in str(e)  # "shape mismatch: value tensor of shape [2, 3] cannot be broadcast ..."
else:
    raise SystemExit("accepted: a different deviation")
assert len(rb) == 4
""",
    ),
    Deviation(
        ("BUF-004",),
        "ReplayBuffer / SamplerWithoutReplacement",
        "sample(n) returns fewer than n items when the current epoch has fewer left",
        """import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8), sampler=SamplerWithoutReplacement())
rb.extend(TensorDict({"a": torch.arange(5)}, batch_size=[5]))
rb.sample(4)
assert rb.sample(5).batch_size == torch.Size([1])  # asked for 5
""",
    ),
    Deviation(
        ("BUF-018",),
        "ReplayBuffer / LazyStackStorage (ListStorage)",
        "dumps refuses list-backed storages, so ragged buffers cannot be checkpointed with it",
        """import tempfile
import torch
from tensordict import TensorDict
from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyStackStorage(8))
rb.extend(TensorDict({"a": torch.arange(2)}, batch_size=[2]))
try:
    rb.dumps(tempfile.mkdtemp())
    raise SystemExit("dumps worked: the deviation is fixed")
except NotImplementedError as e:
    assert "ListStorage" in str(e)
""",
    ),
    Deviation(
        ("BUF-006",),
        "ReplayBuffer / LazyStackStorage (ListStorage)",
        "extend keeps the caller's tensors (views of its rows): writing into the batch afterwards changes the stored items",
        """import torch
from tensordict import TensorDict
from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyStackStorage(8))
batch = TensorDict({"a": torch.arange(4.0)}, batch_size=[4])
rb.extend(batch)
batch["a"].fill_(99.0)  # the caller reuses its tensor
assert rb[torch.arange(4)]["a"].tolist() == [99.0] * 4  # the buffer's items changed with it
""",
    ),
    Deviation(
        ("BUF-014",),
        "ReplayBuffer / LazyTensorStorage, LazyMemmapStorage",
        "state_dict() returns the live storage tensors: a snapshot changes with every later extend",
        _HEAD
        + """snapshot = rb.state_dict()  # [1, 1] in "a"
rb.extend(TensorDict({"a": torch.full((8,), 5.0), "b": torch.ones(8)}, batch_size=[8]))
fresh = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
fresh.load_state_dict(snapshot)
assert fresh[torch.arange(2)]["a"].tolist() == [5.0, 5.0]  # the later write, not the snapshot's
""",
    ),
    Deviation(
        ("BUF-024",),
        "ReplayBuffer.loads / LazyTensorStorage, LazyMemmapStorage (local and Ray-served)",
        "loads unpickles prefetch.pkl (a planted pickle runs its code) and, refusing a damaged "
        "file, leaves the storage already replaced",
        _HEAD
        + """import os, pathlib, pickle, tempfile
d = pathlib.Path(tempfile.mkdtemp())
rb.dumps(d / "ckpt")
marker = d / "ran"
class Payload:
    def __reduce__(self):
        return (pathlib.Path.touch, (marker,))
(d / "ckpt" / "prefetch.pkl").write_bytes(pickle.dumps(Payload()))
TensorDictReplayBuffer(storage=LazyTensorStorage(8)).loads(d / "ckpt")
assert marker.exists()  # loading the checkpoint ran the planted code
other = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
other.extend(TensorDict({"a": torch.zeros(3), "b": torch.zeros(3)}, batch_size=[3]))
(d / "ckpt" / "buffer_metadata.json").write_text("not json")
try:
    other.loads(d / "ckpt")
except Exception:
    pass
assert len(other) == 2  # refused, yet the storage is the checkpoint's (it held 3 items)
""",
    ),
)
"""Known deviations of TorchRL 0.14.1's buffers, found by the buffer suite."""

_LOSS_HEAD = """import torch
from tensordict import TensorDict
from torchrl.objectives.llm import GRPOLoss
"""

LOSS_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("LOSS-008",),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "an unknown aggregation silently falls back to token_mean, and misspelt keyword arguments are swallowed by **kwargs",
        _LOSS_HEAD
        + """loss = GRPOLoss(None, aggregation="token_meen", entropy_coef=0.5)  # typo'd value, typo'd keyword
assert loss.aggregation == "token_meen"   # kept as given; forward() then takes the token_mean branch
assert loss.entropy_coeff == 0.01         # the intended 0.5 went into **kwargs and was ignored
""",
    ),
    Deviation(
        ("LOSS-001",),
        "GRPOLoss (and DAPO, CISPOLoss) with aggregation='prompt_mean'",
        "prompt_mean returns loss terms of shape [1] instead of scalars",
        """# Needs an actor; with posttrain installed the suite's tiny policy is at hand:
from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch
from posttrain.testing import tiny_causal_lm
from torchrl.objectives.llm import GRPOLoss

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf", aggregation="prompt_mean")
out = loss(to_torchrl_layout(llm_batch(4, 10, vocab_size=64)))
assert out.loss_objective.shape == (1,)
""",
    ),
    Deviation(
        ("LOSS-005", "LOSS-012"),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "entropy, clip_fraction and kl_approx are averaged over every position of the padded batch, so padding and prompt length change them",
        """from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch
from posttrain.testing import tiny_causal_lm
from torchrl.objectives.llm import GRPOLoss
import torch

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf")
td = llm_batch(4, 10, vocab_size=64)
padded = td.apply(lambda x: torch.cat([x, x.new_zeros(4, 3)], 1) if x.ndim == 2 else x)
with torch.no_grad():
    a, b = loss(to_torchrl_layout(td)), loss(to_torchrl_layout(padded))
for name in ("entropy", "clip_fraction", "kl_approx"):
    # three padding columns shrink each by 40/52 (the share of real positions): 1.35 -> 1.04 entropy
    assert torch.isclose(b.get(name), a.get(name) * 40 / 52), name
""",
    ),
    Deviation(
        ("LOSS-009",),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "a mask of the wrong dtype is not refused by name: a float assistant mask fails on '~' naming no key, an int64 attention mask is accepted",
        """from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch
from posttrain.testing import tiny_causal_lm
from torchrl.objectives.llm import GRPOLoss
import torch

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf")
td = llm_batch(4, 10, vocab_size=64)
bad = td.clone()
bad.set(("masks", "all_assistant_mask"), td.get(("masks", "all_assistant_mask")).float())
try:
    loss(to_torchrl_layout(bad))
    raise SystemExit("a float assistant mask was accepted: a different deviation")
except TypeError as e:
    assert "assistant" not in str(e)  # "~ (operator.invert) is only implemented on integer ..."
bad = td.clone()
bad.set(("masks", "all_attention_mask"), td.get(("masks", "all_attention_mask")).long())
out = loss(to_torchrl_layout(bad))  # accepted: no error names the key or the dtype
assert torch.isfinite(out.loss_objective).all()
""",
    ),
    Deviation(
        ("LOSS-015",),
        "GRPOLoss (and DAPO, CISPOLoss)",
        "an advantage of shape [B, 1] (TorchRL's [B, 1, 1]) is broadcast along the tokens instead of refused",
        """from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch
from posttrain.testing import tiny_causal_lm
from torchrl.objectives.llm import GRPOLoss
import torch

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf")
td = llm_batch(4, 10, vocab_size=64)
td.set("advantage", td.get("advantage")[:, None])  # [B, 1]: neither [B] nor [B, T]
out = loss(to_torchrl_layout(td))  # accepted: broadcast to every token, no error names the key
assert torch.isfinite(out.loss_objective).all()
""",
    ),
    Deviation(
        ("LOSS-010",),
        "GRPOLoss (and DAPO, CISPOLoss) with kl_to_ref_coeff",
        "the KL to the reference is averaged over every position of the padded batch, so padding dilutes it",
        """from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch
from posttrain.testing import tiny_causal_lm
from torchrl.objectives.llm import GRPOLoss
import torch

ref = ("next", "ref_log_probs", "full")
loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf", kl_to_ref_coeff=0.1)
td = llm_batch(4, 10, vocab_size=64)
td.set(ref, td.get(("log_probs", "full")) - 0.5)  # the same gap on every assistant token
padded = td.apply(lambda x: torch.cat([x, x.new_zeros(4, 3)], 1) if x.ndim == 2 else x)
with torch.no_grad():
    a = loss(to_torchrl_layout(td)).loss_kl_to_ref
    b = loss(to_torchrl_layout(padded)).loss_kl_to_ref
assert b < a  # three padding columns shrank the KL penalty (it is .mean() over positions)
""",
    ),
)
"""Known deviations of TorchRL 0.14.1's LLM losses, found by the loss suite."""

_COLLECTOR_HEAD = """import tensordict
import torch
from posttrain.adapters.torchrl.rollout import llm_collector  # LLMCollector + TransformersWrapper
from posttrain.testing import tiny_causal_lm

tensordict.set_list_to_stack(True).set()
model = tiny_causal_lm()
src = llm_collector(model, [[5, 6, 7], [8, 9]], None, max_new_tokens=4)
collector = src.collector  # torchrl.collectors.llm.LLMCollector(..., track_policy_version=True)
"""

ROLLOUT_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("ROLL-001",),
        "TransformersWrapper(generate=True, pad_output=False)",
        "when the tokenizer's pad token is its EOS token (as in many real tokenizers), the EOS that ends a response is taken for padding (masks are tokens != pad_token_id) and dropped from the response and the masks",
        _COLLECTOR_HEAD
        + """from posttrain.conformance.suites.rollout import scripted_weights

model.load_state_dict(scripted_weights(model, 0))  # after token 9: token 20, then EOS (2)
model.config.pad_token_id = model.generation_config.pad_token_id = model.config.eos_token_id
src = llm_collector(model, [[8, 9]], None, max_new_tokens=4)  # the tokenizer's pad is EOS too
td = next(iter(src.collector))
assert td.get(("tokens", "response"), as_list=True)[0].tolist() == [20]  # generated: [20, 2]
assert td.get(("tokens", "full"), as_list=True)[0].tolist() == [8, 9, 20]
src.shutdown()
""",
    ),
    Deviation(
        ("ROLL-008",),
        "TransformersWrapper(generate=True, return_log_probs=True)",
        "the log-prob of the first generated token is set to 0 (_log_probs_generate: log_probs[:, 0] = 0)",
        """import torch
from tensordict import TensorDict, lazy_stack
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies import Tokens
from posttrain.adapters.torchrl._tokenizer import word_level_tokenizer  # a local WordLevel tokenizer
from posttrain.testing import tiny_causal_lm  # a 1-layer Llama built from a config

model = tiny_causal_lm()
gen = TransformersWrapper(model, tokenizer=word_level_tokenizer(model.config), input_mode="tokens",
                          return_log_probs=True, pad_output=False,
                          generate_kwargs={"max_new_tokens": 3, "do_sample": False})
out = gen(lazy_stack([TensorDict(tokens=Tokens(prompt=torch.tensor([5, 6, 7])), batch_size=())]))
full = out[0]["tokens", "full"]
with torch.no_grad():
    logp = model(full[None]).logits[0].log_softmax(-1)[:-1].gather(-1, full[1:, None])[:, 0]
returned = out[0]["log_probs", "response"]
assert returned[0] == 0.0 and logp[2] < -1.0    # first response token: 0 instead of log p
assert torch.allclose(returned[1:], logp[3:])   # the later ones are right
""",
        blocked_by=("ROLL-001",),
    ),
    Deviation(
        ("ROLL-004",),
        "LLMCollector.update_policy_weights_",
        "a plain state dict (documented as accepted: 'dict: A regular dict containing weights') fails with AttributeError",
        _COLLECTOR_HEAD
        + """next(iter(src))
try:
    collector.update_policy_weights_(model.state_dict())
    raise SystemExit("accepted: the deviation is fixed")
except AttributeError as e:
    assert "'data'" in str(e)  # 'collections.OrderedDict' object has no attribute 'data'
assert collector.policy_version == 0
""",
        blocked_by=("ROLL-001",),
    ),
    Deviation(
        ("ROLL-003", "ROLL-004"),
        "LLMCollector(track_policy_version=True)",
        "the root policy_version is stamped when the prompt is loaded, so a batch generated after an update still carries the old version (('next', 'policy_version') is right)",
        _COLLECTOR_HEAD
        + """from tensordict import TensorDict

it = iter(collector)
next(it)
collector.update_policy_weights_(TensorDict(src.collector.policy.state_dict()).unflatten_keys("."))
batch = next(it)
assert collector.policy_version == 1
assert batch["policy_version"].tolist() == [0, 0]            # generated by version 1
assert batch["next", "policy_version"].tolist() == [1, 1]
""",
        blocked_by=("ROLL-001",),
    ),
)
"""Known deviations of TorchRL 0.14.1's LLMCollector and TransformersWrapper, found by the rollout suite."""


_WS_HEAD = """import torch
from tensordict import TensorDict
from torchrl.collectors import VanillaWeightUpdater  # update_policy_weights_'s local path

receiver = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
updater = VanillaWeightUpdater(policy_weights=TensorDict.from_module(receiver).data)
before = {k: v.clone() for k, v in receiver.state_dict().items()}
new = {k: torch.randn_like(v) for k, v in before.items()}
"""

WEIGHT_SYNC_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("WS-004",),
        "VanillaWeightUpdater, SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme",
        "a wrong shape fails part-way: earlier tensors are already overwritten and the error names no parameter",
        _WS_HEAD
        + """new["1.bias"] = torch.zeros(3)  # the last tensor has a wrong shape
try:
    with torch.no_grad():
        updater.push_weights(TensorDict(new).unflatten_keys("."))
    raise SystemExit("accepted")
except RuntimeError as e:
    assert "1.bias" not in str(e) and "bias" not in str(e)  # "The size of tensor a (2) must match ..."
assert not torch.equal(receiver[0].weight, before["0.weight"])  # half-written
assert torch.equal(receiver[1].bias, before["1.bias"])
""",
    ),
    Deviation(
        ("WS-005",),
        "VanillaWeightUpdater, SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme",
        "a tensor of the wrong dtype is cast silently",
        _WS_HEAD
        + """new["1.bias"] = new["1.bias"].double()
with torch.no_grad():
    updater.push_weights(TensorDict(new).unflatten_keys("."))
assert receiver[1].bias.dtype == torch.float32  # float64 accepted and cast, no error
""",
    ),
    Deviation(
        ("WS-006",),
        "VanillaWeightUpdater, SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme",
        "a missing name keeps the old tensor and an unknown name is ignored, both silently",
        _WS_HEAD
        + """del new["1.bias"]
new["2.weight"] = torch.zeros(1)  # no such parameter
with torch.no_grad():
    updater.push_weights(TensorDict(new).unflatten_keys("."))
assert torch.equal(receiver[1].bias, before["1.bias"])  # stale, silently
""",
    ),
    Deviation(
        ("WS-004",),
        "MultiProcessWeightSyncScheme (sync=True)",
        "after a wrong shape the receiver only logs the error and never acknowledges, so send() blocks forever",
        """import copy, threading
import torch
from tensordict import TensorDict
from torchrl.weight_update import MultiProcessWeightSyncScheme

receiver = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
scheme = MultiProcessWeightSyncScheme()
scheme.init_on_sender(weights=TensorDict.from_module(receiver).data.clone(), devices=[torch.device("cpu")])
worker = copy.copy(scheme)  # the worker's end, here in the same process
worker.init_on_receiver(model_id="policy", model=receiver, worker_idx=0)
scheme.connect()
worker.connect(worker_idx=0)
bad = TensorDict.from_module(receiver).data.clone()
bad["1", "bias"] = torch.zeros(3)
t = threading.Thread(target=scheme.send, args=(bad,), daemon=True)
t.start()
t.join(timeout=10)
assert t.is_alive()  # still waiting for an acknowledgement that never comes
worker.shutdown()
""",
    ),
)
"""Known deviations of TorchRL 0.14.1's weight transports, found by the weight-sync suite."""


_SERVER = """import concurrent.futures
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer

policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["x"], out_keys=["y"])
"""

GENERATION_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("GEN-005",),
        "InferenceServer (thread backend)",
        "update_policy_weights_ bumps the version without the model lock, and a batch is stamped when its forward ends: a batch in flight during an update is stamped with the new version",
        _SERVER
        + """import threading

entered, release = threading.Event(), threading.Event()

def hold(module, args, output):  # the batch stays in the model until released
    entered.set()
    release.wait(10)

policy.register_forward_hook(hold)
server = InferenceServer(policy, transport="auto").start()
inflight = server.client().submit(TensorDict({"x": torch.ones(2)}))
assert entered.wait(10)  # computed by version 0's weights, not yet stamped
server.update_policy_weights_()  # returns at once, the batch still in the model
release.set()
assert int(inflight.result(10)["policy_version"]) == 1  # stamped with the later version
server.shutdown()
""",
    ),
    Deviation(
        ("GEN-006",),
        "InferenceServer (thread backend)",
        "update_policy_weights_(model_id, weights) bumps the version but loads nothing",
        _SERVER
        + """server = InferenceServer(policy, transport="auto", min_batch_size=2, timeout=1.0).start()
client = server.client()
before = [client.submit(TensorDict({"x": torch.ones(2)})) for _ in range(2)][0].result(10)
server.update_policy_weights_(None, {k: torch.zeros_like(v) for k, v in policy.state_dict().items()})
after = [client.submit(TensorDict({"x": torch.ones(2)})) for _ in range(2)][0].result(10)
assert int(after["policy_version"]) == 1 and torch.equal(after["y"], before["y"])  # old weights
server.shutdown()
""",
    ),
    Deviation(
        ("GEN-007",),
        "InferenceServer (thread backend)",
        "a malformed request reaches the model and its error fails every request of the batch",
        _SERVER
        + """server = InferenceServer(policy, transport="auto", min_batch_size=2, timeout=1.0).start()
client = server.client()
good = client.submit(TensorDict({"x": torch.ones(2)}))
bad = client.submit(TensorDict({"z": torch.ones(2)}))  # "x" missing
assert isinstance(good.exception(10), KeyError)  # the valid request fails with the bad one
server.shutdown()
""",
    ),
    Deviation(
        ("GEN-009",),
        "InferenceServer (thread backend)",
        "a request submitted after shutdown() is never answered nor failed",
        _SERVER
        + """server = InferenceServer(policy, transport="auto").start()
client = server.client()
server.shutdown()
future = client.submit(TensorDict({"x": torch.ones(2)}))
try:
    future.result(timeout=2)
    raise AssertionError("answered")
except concurrent.futures.TimeoutError:
    pass  # still pending: the caller waits forever without a timeout
""",
    ),
    Deviation(
        ("GEN-010",),
        "InferenceServer (thread backend)",
        "stats() reports p50/p95 milliseconds and avg_batch_size, not queue_wait_s/batch_size/forward_s",
        _SERVER
        + """server = InferenceServer(policy, transport="auto").start()
server.client().submit(TensorDict({"x": torch.ones(2)})).result(10)
stats = server.stats()
assert "p50_queue_ms" in stats and "queue_wait_s" not in stats
server.shutdown()
""",
    ),
)
"""TorchRL's InferenceServer against the generation contract, with executable repros."""


RAY_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("BUF-009", "BUF-023"),
        'TensorDictReplayBuffer(service_backend="ray") (RayReplayBuffer)',
        "a producer's batch with a key missing is stored through a client, like the local buffer's",
        """import ray
import torch
from functools import partial
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
rb = TensorDictReplayBuffer(storage=partial(LazyTensorStorage, 8), sampler=RandomSampler,
                            service_backend="ray",
                            service_backend_options={"remote_config": {"num_cpus": 0}})
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))

@ray.remote(num_cpus=0)
def producer(client):
    return client.extend(TensorDict({"a": torch.ones(2)}, batch_size=[2])).tolist()

print(ray.get(producer.remote(rb.client())))  # [2, 3]: accepted, "b" missing
assert len(rb) == 4
rb.close()
""",
    ),
    Deviation(
        ("WS-004", "WS-005", "WS-006"),
        "RayWeightSyncScheme",
        "weights of the wrong size abort the receiving actor's process; same-size weights of "
        "another dtype are reinterpreted bit for bit and acknowledged",
        """import ray
import torch
from tensordict import TensorDict
from torchrl.weight_update import RayWeightSyncScheme

ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)

@ray.remote(num_cpus=0)
class Receiver:
    def __init__(self, scheme):
        self.model = torch.nn.Linear(4, 4)
        self.scheme = scheme
        scheme.init_on_receiver(model_id="policy", worker_idx=0, model=self.model)
    def connect(self):
        self.scheme.connect(worker_idx=0)
    def _receive_weights_scheme(self, model_version=None):  # called by RayTransport
        self.scheme.receive()
    def weight(self):
        return self.model.weight.detach().clone()

def pair():
    scheme = RayWeightSyncScheme(backend="gloo")
    actor = Receiver.remote(scheme)
    scheme.init_on_sender(model_id="policy", remote_collectors=[actor], num_workers=1,
                          model=torch.nn.Linear(4, 4))
    ray.get(actor.weight.remote())
    joined = actor.connect.remote(); scheme.connect(); ray.get(joined)
    return scheme, actor

scheme, actor = pair()
new = TensorDict.from_module(torch.nn.Linear(4, 4)).data.apply(torch.ones_like)
scheme.send(weights=new.to(torch.int32))  # same size, other dtype: accepted
got = ray.get(actor.weight.remote())
assert torch.equal(got.view(torch.int32), torch.ones(4, 4, dtype=torch.int32))  # 1.4e-45, not 1.0
try:
    scheme.send(weights=new.double())  # twice the bytes per tensor
    raise SystemExit("accepted")
except Exception as e:
    assert "ActorDiedError" in type(e).__name__ or "died" in str(e)  # the receiver aborted
scheme.shutdown()
""",
    ),
)
"""Known deviations of TorchRL 0.14.1's Ray-served buffer and Ray weight-sync scheme."""

LOGGER_DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        ("MET-002",),
        "WandbLogger",
        'a metric named "step" or "<group>/step" is taken for a step counter: its value becomes '
        "the step of its group and its own step is lost",
        """import glob
import json
import subprocess
import sys
import tempfile

from torchrl.record.loggers.wandb import WandbLogger

d = tempfile.mkdtemp()
logger = WandbLogger(exp_name="x", offline=True, mode="offline", save_dir=d, log_env_packages=False)
logger.log_scalar("loss", 0.25, step=3)  # stored with its step in the column "step"
logger.log_scalar("step", 0.5, step=7)  # a metric named "step" (or "<group>/step")
logger.close()
(path,) = glob.glob(f"{d}/wandb/offline-run-*/run-*.wandb")
out = subprocess.run(
    [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],  # W&B's own reader
    capture_output=True, text=True, check=True,
).stdout
rows = [r["history"]["item"] for r in map(json.loads, out.splitlines()) if r["type"] == "history"]
rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
assert rows == [{"loss": 0.25, "step": 3}, {"step": 0.5}], rows  # 0.5 became a step; step 7 is lost
""",
    ),
    Deviation(
        ("MET-007",),
        "CSVLogger",
        "a value logged without a step goes to the count of the name's values so far, not one "
        "past its highest step: after step 5 it lands at step 1, back in time",
        """import pathlib
import tempfile

from torchrl.record.loggers.csv import CSVLogger

d = tempfile.mkdtemp()
logger = CSVLogger(exp_name="x", log_dir=d)
logger.log_scalar("loss", 0.5, step=5)
logger.log_scalar("loss", 0.25)  # no step: expected at 6
(path,) = pathlib.Path(d).rglob("loss.csv")
assert path.read_text().split() == ["5,0.5", "1,0.25"], path.read_text()  # step 1
""",
    ),
    Deviation(
        ("MET-007",),
        "TensorboardLogger",
        "every value logged without a step is stored at step 0 (SummaryWriter's default)",
        """import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchrl.record.loggers.tensorboard import TensorboardLogger

d = tempfile.mkdtemp()
logger = TensorboardLogger(exp_name="x", log_dir=d)
for value in (0.5, 0.25, 0.125):
    logger.log_scalar("loss", value)  # no step: expected at 0, 1, 2
logger.experiment.close()
acc = EventAccumulator(logger.experiment.log_dir)
acc.Reload()
assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 0.5), (0, 0.25), (0, 0.125)]
""",
    ),
)
"""Known deviations of TorchRL 0.14.1's loggers (run in a fresh interpreter: W&B is per process)."""
