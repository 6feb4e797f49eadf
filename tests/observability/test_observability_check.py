"""The crafted-batch check passes posttrain's hooks and fails the formulas the frameworks use."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from tensordict import TensorDictBase

from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import policy_metrics
from posttrain.observability.hook_compare import CASES, CHECKED, compare_policy_hook

K = LLM_LAYOUT_V1.key


def _parts(td: TensorDictBase, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    tokens = td.get(K("tokens"))
    logp = token_log_probs(logits, tokens)
    lp = torch.log_softmax(logits[:, :-1], -1)
    ent = torch.cat([torch.zeros(lp.shape[0], 1), -(lp.exp() * lp).sum(-1)], 1)
    ratio = (logp - td.get(K("sample_log_probs"))).exp()
    d = td.get(K("ref_log_probs")) - logp
    adv = td.get(K("advantage"))[:, None].expand_as(ratio)
    return {"k3": d.exp() - d - 1, "k1": -d, "ent": ent, "ratio": ratio, "adv": adv}


Hook = Callable[[TensorDictBase, torch.Tensor], Mapping[str, float]]


def _hook(mask_of: str, sign_aware: bool = True) -> Hook:
    """A hook with one framework's choices: which positions count, sign-aware clipping or not."""

    def hook(td: TensorDictBase, logits: torch.Tensor) -> Mapping[str, float]:
        p = _parts(td, logits)
        asst = td.get(K("assistant_mask")) & td.get(K("attention_mask"))
        asst[:, 0] = False
        mask = {
            "assistant": asst,
            "every_position": torch.ones_like(asst),  # TorchRL's diagnostics: padded-batch means
            "attention": td.get(K("attention_mask")),  # prompt tokens included
        }[mask_of]
        zero = torch.zeros_like(p["k3"])

        def mean(x: torch.Tensor) -> float:
            return float(torch.where(asst, x, zero).sum() / mask.sum())

        low = (p["ratio"] < 0.8) & ((p["adv"] < 0) if sign_aware else True)
        high = (p["ratio"] > 1.2) & ((p["adv"] > 0) if sign_aware else True)
        out = {
            "policy/kl_ref/k1": mean(p["k1"]),
            "policy/entropy": mean(p["ent"]),
            "policy/ratio/mean": mean(p["ratio"]),
            "policy/clip_frac/low": mean(low.float()),
            "policy/clip_frac/high": mean(high.float()),
        }
        if mask_of == "attention":
            out["policy/kl_ref/k3"] = float((p["k3"] * mask).sum() / mask.sum())
        else:
            out["policy/kl_ref/k3"] = mean(p["k3"])
        return out

    return hook


def test_posttrain_hooks_pass_every_crafted_case() -> None:
    findings = compare_policy_hook(lambda td, logits: policy_metrics(td, logits).values())
    assert len(findings) == len(CASES) * len(CHECKED)
    assert [str(f) for f in findings if not f.ok] == []


def test_means_over_every_position_fail_on_padding() -> None:
    bad = {(f.case, f.metric) for f in compare_policy_hook(_hook("every_position")) if not f.ok}
    assert ("padding", "policy/kl_ref/k3") in bad
    assert ("padding", "policy/entropy") in bad


def test_prompt_tokens_in_the_kl_fail() -> None:
    bad = {(f.case, f.metric) for f in compare_policy_hook(_hook("attention")) if not f.ok}
    assert ("prompt_tokens", "policy/kl_ref/k3") in bad


def test_sign_blind_clipping_fails() -> None:
    bad = {
        (f.case, f.metric)
        for f in compare_policy_hook(_hook("assistant", sign_aware=False))
        if not f.ok
    }
    assert ("clip_signs", "policy/clip_frac/low") in bad or (
        "clip_signs",
        "policy/clip_frac/high",
    ) in bad
    good = {(f.case, f.metric) for f in compare_policy_hook(_hook("assistant")) if not f.ok}
    assert good == set()  # the same hook, sign-aware and masked, is right: the check is fair


def test_multiplying_by_the_mask_fails_on_nan_outside_it() -> None:
    def hook(td: TensorDictBase, logits: torch.Tensor) -> Mapping[str, float]:
        p = _parts(td, logits)
        asst = td.get(K("assistant_mask")) & td.get(K("attention_mask"))
        asst[:, 0] = False
        m = asst.float()
        return {name: float((p[key] * m).sum() / m.sum()) for name, key in (
            ("policy/kl_ref/k3", "k3"), ("policy/kl_ref/k1", "k1"), ("policy/entropy", "ent"),
            ("policy/ratio/mean", "ratio"),
        )}  # fmt: skip

    bad = {(f.case, f.metric) for f in compare_policy_hook(hook) if not f.ok}
    assert ("nan_outside", "policy/kl_ref/k3") in bad
    assert ("nan_outside", "policy/ratio/mean") in bad
    assert ("padding", "policy/kl_ref/k3") not in bad  # finite values outside: no difference
