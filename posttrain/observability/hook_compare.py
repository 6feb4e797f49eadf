"""The crafted-batch check for metric hooks: values must equal the catalogue's formulas.

Each case is a small batch built where the frameworks' formulas disagree: padding columns and
prompt tokens whose values would leak into a mean over positions, advantages of both signs
with ratios on both sides of the clip range, microbatches of uneven token counts. Expected
values are computed here token by token, in plain Python, straight from the catalogue's
formulas, independently of :mod:`posttrain.observability.hooks`.

Example:
    >>> from posttrain.observability import policy_metrics
    >>> [f for f in compare_policy_hook(lambda td, logits: policy_metrics(td, logits).values()) if not f.ok]
    []
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts.layout import LLM_LAYOUT_V1

K = LLM_LAYOUT_V1.key
CLIP = (0.2, 0.2)
CHECKED = (
    "policy/kl_ref/k3",
    "policy/kl_ref/k1",
    "policy/entropy",
    "policy/ratio/mean",
    "policy/clip_frac/low",
    "policy/clip_frac/high",
)
CASES = ("padding", "prompt_tokens", "clip_signs", "nan_outside")


@dataclass(frozen=True)
class Finding:
    """One metric on one crafted case: what the catalogue says and what the hook gave.

    Example:
        >>> f = Finding("padding", "policy/entropy", expected=1.5, found=1.2)
        >>> f.ok
        False
        >>> print(f)
        padding       policy/entropy          expected 1.5, found 1.2  DIFFERS
    """

    case: str
    metric: str
    expected: float
    found: float | None

    @property
    def ok(self) -> bool:
        """Equal within 1e-5 (relative) or both NaN."""
        if self.found is None:
            return False
        if math.isnan(self.expected):
            return math.isnan(self.found)
        return math.isclose(self.found, self.expected, rel_tol=1e-5, abs_tol=1e-7)

    def __str__(self) -> str:
        mark = "ok" if self.ok else "DIFFERS"
        return f"{self.case:<14}{self.metric:<24}expected {self.expected:.6g}, found {self.found!r}  {mark}"


def crafted_cases() -> dict[str, tuple[TensorDictBase, torch.Tensor]]:
    """Case name -> (layout batch, logits [B, T, V]).

    Example:
        >>> cases = crafted_cases()
        >>> list(cases)
        ['padding', 'prompt_tokens', 'clip_signs', 'nan_outside']
        >>> td, logits = cases["padding"]
        >>> td.batch_size, logits.shape
        (torch.Size([2]), torch.Size([2, 10, 6]))
    """
    g = torch.Generator().manual_seed(0)
    v = 6
    out: dict[str, tuple[TensorDictBase, torch.Tensor]] = {}
    # padding: 2 sequences, 3 and 1 assistant tokens, then 5 padding columns whose log-probs,
    # reference log-probs and logits are far from the real ones (they must not count).
    b, t = 2, 10
    attn = torch.zeros(b, t, dtype=torch.bool)
    attn[0, :5], attn[1, :3] = True, True
    asst = torch.zeros(b, t, dtype=torch.bool)
    asst[0, 2:5], asst[1, 2] = True, True
    out["padding"] = (
        _batch(attn, asst, g, v, adv=(1.0, -1.0)),
        torch.randn(b, t, v, generator=g) * 3,
    )
    # prompt_tokens: long prompts whose reference log-probs differ wildly from the policy's.
    attn = torch.ones(2, 8, dtype=torch.bool)
    asst = torch.zeros(2, 8, dtype=torch.bool)
    asst[:, 6:] = True
    td = _batch(attn, asst, g, v, adv=(0.5, 2.0))
    td.set(K("ref_log_probs"), torch.where(asst, td.get(K("ref_log_probs")), -30.0))
    out["prompt_tokens"] = (td, torch.randn(2, 8, v, generator=g))
    # clip_signs: ratios far on both sides under both advantage signs.
    attn = torch.ones(4, 6, dtype=torch.bool)
    asst = torch.zeros(4, 6, dtype=torch.bool)
    asst[:, 2:] = True
    td = _batch(attn, asst, g, v, adv=(1.0, -1.0, 1.0, -1.0))
    logits = torch.randn(4, 6, v, generator=g) * 4
    out["clip_signs"] = (td, logits)
    # nan_outside: NaN log-probs wherever the mask is False (TorchRL writes NaN outside the
    # response): a hook multiplying by the mask instead of selecting turns every mean NaN.
    attn = torch.ones(3, 7, dtype=torch.bool)
    attn[2, 5:] = False
    asst = torch.zeros(3, 7, dtype=torch.bool)
    asst[:, 3:] = True
    td = _batch(attn, asst, g, v, adv=(1.0, -1.0, 0.5))
    unread = ~(asst & attn)
    unread[:, 0] = True
    for key in ("sample_log_probs", "ref_log_probs"):
        td.set(K(key), td.get(K(key)).masked_fill(unread, math.nan))
    out["nan_outside"] = (td, torch.randn(3, 7, v, generator=g) * 2)
    return out


def _batch(
    attn: torch.Tensor, asst: torch.Tensor, g: torch.Generator, v: int, adv: tuple[float, ...]
) -> TensorDict:
    b, t = attn.shape
    return TensorDict(
        {
            K("tokens"): torch.randint(0, v, (b, t), generator=g),
            K("attention_mask"): attn,
            K("assistant_mask"): asst,
            K("sample_log_probs"): -torch.rand(b, t, generator=g) * 3,
            K("ref_log_probs"): -torch.rand(b, t, generator=g) * 3,
            K("advantage"): torch.tensor(adv),
        },
        batch_size=[b],
    )


def expected(td: TensorDictBase, logits: torch.Tensor) -> dict[str, float]:
    """The catalogue's values, token by token in plain Python.

    Example:
        >>> from posttrain.observability import policy_metrics
        >>> td, logits = crafted_cases()["padding"]
        >>> round(expected(td, logits)["policy/entropy"], 4)
        1.1114
        >>> round(policy_metrics(td, logits).values()["policy/entropy"], 4)  # the hook agrees
        1.1114
    """
    tokens = td.get(K("tokens")).tolist()
    attn = td.get(K("attention_mask")).tolist()
    asst = td.get(K("assistant_mask")).tolist()
    old = td.get(K("sample_log_probs")).tolist()
    ref = td.get(K("ref_log_probs")).tolist()
    adv = td.get(K("advantage")).tolist()
    lsm = torch.log_softmax(logits.double(), -1).tolist()
    sums = dict.fromkeys(CHECKED, 0.0)
    n = 0
    for i, row in enumerate(tokens):
        for t in range(1, len(row)):  # position 0 is never predicted
            if not (asst[i][t] and attn[i][t]):
                continue
            n += 1
            dist = lsm[i][t - 1]
            logp = dist[row[t]]
            d = ref[i][t] - logp
            ratio = math.exp(logp - old[i][t])
            sums["policy/kl_ref/k3"] += math.exp(d) - d - 1
            sums["policy/kl_ref/k1"] += -d
            sums["policy/entropy"] += -sum(math.exp(p) * p for p in dist)
            sums["policy/ratio/mean"] += ratio
            sums["policy/clip_frac/low"] += float(ratio < 1 - CLIP[0] and adv[i] < 0)
            sums["policy/clip_frac/high"] += float(ratio > 1 + CLIP[1] and adv[i] > 0)
    return {k: s / n if n else math.nan for k, s in sums.items()}


def compare_policy_hook(
    hook: Callable[[TensorDictBase, torch.Tensor], Mapping[str, float]],
) -> list[Finding]:
    """Every checked metric on every crafted case: ``hook(td, logits) -> {name: value}``.

    Example:
        >>> from posttrain.observability import policy_metrics
        >>> def hook(td, logits):  # posttrain's hook with its entropy broken
        ...     return policy_metrics(td, logits).values() | {"policy/entropy": 0.0}
        >>> print(*[f for f in compare_policy_hook(hook) if not f.ok], sep="\\n")
        padding       policy/entropy          expected 1.11142, found 0.0  DIFFERS
        prompt_tokens policy/entropy          expected 1.5643, found 0.0  DIFFERS
        clip_signs    policy/entropy          expected 0.481371, found 0.0  DIFFERS
        nan_outside   policy/entropy          expected ..., found 0.0  DIFFERS
    """
    findings = []
    for case, (td, logits) in crafted_cases().items():
        got = hook(td, logits)
        want = expected(td, logits)
        for metric in CHECKED:
            v = got.get(metric)
            findings.append(Finding(case, metric, want[metric], None if v is None else float(v)))
    return findings
