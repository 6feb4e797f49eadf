"""Write docs/reports/losses.md: every policy-gradient loss of the field through the loss suite.

One row per framework, loss and aggregation, raw and adapted: the reference loss, NeMo-RL's
adapter, TorchRL's LLM losses, verl's registered policy losses, TRL's GRPOTrainer loss per
``loss_type`` and OpenRLHF's PolicyLoss. Each row says which requirements it meets and fails
(a repro command for each failure), whether micro-batches add up (LOSS-017), and the gradient
weight it gives one token of a short and of a long answer, in one batch and in micro-batches,
measured here.

Run with ``make losses-report``. Lives outside the package: it joins the kit and the adapters,
which the import rule keeps apart inside posttrain.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from posttrain.conformance.outcome import Report, Status
from posttrain.conformance.runner import run
from posttrain.conformance.suites.loss_kit import (
    logp_grads as _logp_grads,  # the suite's own gradient reading
)
from posttrain.conformance.target import discover
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts
from posttrain.testing import llm_batch, tiny_causal_lm

K = LLM_LAYOUT_V1.key
V = 64
LENGTHS, PROMPT = (2, 8, 5), 3
"""The measured batch: answers of 2, 8 and 5 tokens after 3 prompt tokens, advantage 1 (the
batch the suite's LOSS-017 measures a loss without global counts on)."""


def rows() -> list[tuple[str, str, Implementation]]:
    """(framework, row name, implementation) for every loss row of the field."""
    from posttrain.adapters.openrlhf.implementations import ROWS as OPENRLHF
    from posttrain.adapters.torchrl.implementations import LOSSES as TORCHRL
    from posttrain.adapters.trl.implementations import ROWS as TRL_MORE
    from posttrain.adapters.trl.loss import ROWS as TRL
    from posttrain.adapters.verl.implementations import ROWS as VERL
    from posttrain.adapters.verl.implementations import USERS_ROWS as VERL_USERS

    eps = discover()
    out: list[tuple[str, str, Implementation]] = []
    for prefix, fw in (("reference-loss-", "posttrain reference"), ("nemo-rl-loss-", "NeMo-RL")):
        for name in sorted(eps):
            if name.startswith(prefix):
                out.append((fw, name, eps[name].load()))
    out += [("TorchRL", n, i) for n, i in TORCHRL.items()]
    out += [("verl", n, i) for n, i in {**VERL, **VERL_USERS}.items()]
    out += [("TRL", n, i) for n, i in {**TRL, **TRL_MORE}.items()]
    out += [("OpenRLHF", n, i) for n, i in OPENRLHF.items()]
    return out


def _batch(policy: Any) -> Any:
    t = PROMPT + max(LENGTHS) + 1
    td = llm_batch(len(LENGTHS), t, vocab_size=V, seed=17)
    pos = torch.arange(t).expand(len(LENGTHS), t)
    att = pos < (PROMPT + torch.tensor(LENGTHS))[:, None]
    td.set(K("attention_mask"), att)
    td.set(K("assistant_mask"), att & (pos >= PROMPT))
    with torch.no_grad():
        lp = token_log_probs(
            policy(input_ids=td.get(K("tokens")), attention_mask=att.long()).logits,
            td.get(K("tokens")),
        )
    # 0 outside the mask (finite, as the frameworks' own pipelines have there): the weights
    # measure the aggregation, not how NaN padding is handled (the suite checks that).
    lp = torch.where(td.get(K("assistant_mask")), lp, 0.0)
    td.set(K("sample_log_probs"), lp)
    td.set(K("ref_log_probs"), lp.clone())
    td.set(K("advantage"), torch.ones(len(LENGTHS)))
    return td


def _unfused(loss: Any) -> None:
    """TRL scores tokens through its fused LM head, which the suite's logits probe cannot see:
    for the measurement, its trainer computes the same log-probs through the logits (equal
    to TRL's fused values within 5e-7 on this model)."""
    trainer = loss.trainer

    def logps(model: Any, input_ids: Any, attention_mask: Any, keep: int, *a: Any, **k: Any) -> Any:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        lp = token_log_probs(logits, input_ids)[:, -keep:]
        return lp, torch.zeros_like(lp), None

    trainer._get_per_token_logps_and_entropies = logps


def weights(framework: str, impl: Implementation) -> tuple[float, float, float, float, str]:
    """Gradient weight of one token of the 2-token and of the 8-token answer: in one batch,
    and with the 2-token answer in one micro-batch and the others in a second, accumulated as
    the framework accumulates (the summed parts under global counts; TRL's own
    num_items_in_batch and accumulation steps for its raw rows; otherwise the mean of the
    micro-batch losses, as users write it; verl's and OpenRLHF's raw rows get the whole batch's
    batch_num_tokens / global_batch_size, as their trainers pass them). Returns the four weights and how they were
    accumulated."""
    policy = tiny_causal_lm(vocab_size=V, seed=0)
    loss = impl.factory(policy, **impl.options)
    if framework != "TRL":
        return _weights(framework, impl, policy, loss)
    trainer = loss.trainer  # shared by the TRL rows of one loss_type: restored after
    saved = trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation
    _unfused(loss)
    try:
        return _weights(framework, impl, policy, loss)
    finally:
        del trainer._get_per_token_logps_and_entropies  # the class's fused path again
        trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation = saved


def _weights(
    framework: str, impl: Implementation, policy: Any, loss: Any
) -> tuple[float, float, float, float, str]:
    td = _batch(policy)
    _, g = _logp_grads(policy, loss, td)
    one = (-float(g[0, PROMPT]), -float(g[1, PROMPT]))
    parts = [td[[0]], td[[1, 2]]]
    whole = GlobalCounts.of(td)
    call: Callable[[Any], Any]
    if "global_counts" in impl.capabilities:
        how, scale = "sum of parts, global counts", 1.0

        def call(x: Any) -> Any:
            return loss(x, counts=whole)
    elif framework == "TRL":  # TRL's trainer: 2 accumulation steps, its num_items_in_batch
        how, scale = "TRL: 2 accumulation steps, num_items_in_batch of the whole batch", 1.0
        loss.trainer.current_gradient_accumulation_steps = 2
        loss.trainer.args.steps_per_generation = 2

        def call(x: Any) -> Any:
            return loss(x, num_items_in_batch=whole.tokens)
    elif framework in ("verl", "OpenRLHF"):  # their trainers pass the global batch's figures
        how, scale = f"{framework}: sum of parts, its own batch_num_tokens/global_batch_size", 1.0
        info = {
            "dp_size": 1,
            "batch_num_tokens": whole.tokens,
            "global_batch_size": whole.sequences,
        }

        def call(x: Any) -> Any:
            return loss(x, global_batch_info=info)
    else:
        how, scale = "mean of the 2 micro-batch losses", 0.5
        call = loss
    _, g_short = _logp_grads(policy, call, parts[0])
    _, g_long = _logp_grads(policy, call, parts[1])
    acc = (-float(g_short[0, PROMPT]) * scale, -float(g_long[0, PROMPT]) * scale)
    return one[0], one[1], acc[0], acc[1], how


def settings(framework: str, name: str) -> str:
    """The framework settings a row runs with that differ from the framework's defaults,
    each with the row that runs the default (or why there is none)."""
    out: list[str] = []
    if framework == "TRL":
        if not name.endswith("-bf16-default"):
            out.append(
                "`bf16=False` (default True: bfloat16 autocast, the suite is float32; "
                "`trl-adapted-dapo-bf16-default`)"
            )
        out.append(
            "`max_completion_length=16` (default 256: dr_grpo's constant, declared `t_norm`)"
        )
        if "cispo" in name and not name.endswith("-default"):
            out.append(
                "`epsilon_high=5.0` (default: `epsilon`, 0.2, the weight's bound itself: "
                "`trl-adapted-cispo-default`)"
            )
    elif framework == "verl":
        if "-adapted-" in name and name.endswith("sum-norm"):
            out.append(
                "`loss_scale_factor=16` (default None: the tensor's width; "
                "`verl-users-vanilla-seq-mean-token-sum-norm`)"
            )
        if "-dro-" in name:
            out.append("`dro_beta=0.1` (no default: verl's dro refuses None)")
    elif framework == "TorchRL":
        if name.endswith("-kl"):
            out.append("`kl_to_ref_coeff=0.1` (default None: the row without `-kl`)")
        if "-dapo-" in name:
            out.append("`clip_epsilon=(0.2, 0.28)` (default 0.2: the grpoloss rows)")
    elif framework == "OpenRLHF" and "dual-clip" in name:
        out.append("`dual_clip=3.0` (default None: the ppo rows)")
    return "; ".join(out) or "defaults"


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _link(rid: str) -> str:
    return f"[{rid}](../../specs/loss-v1.md#{rid})"


def _shape(msg: str) -> str:
    """A failure message with its numbers blanked: the same deviation on several rows."""
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", msg)


def main(out_dir: Path) -> tuple[Path, int]:
    """Write the report; return its path and 1 if a row failed other than it declares."""
    started = time.time()
    table: list[str] = []
    deviations: dict[tuple[str, str, str], list[tuple[str, str, str]]] = {}
    unexpected: list[str] = []
    reports: dict[str, Report] = {}
    tally: dict[str, list[int]] = {}  # framework -> [rows, conforming, split-dependent, measured]
    only = os.environ.get("LOSSES_ONLY", "")  # a substring of row names: a quicker partial run
    for framework, name, impl in rows():
        if only not in name:
            continue
        rep = run(impl)
        reports[name] = rep
        failed = sorted(rep.failed_ids())
        if set(failed) != set(impl.known_failures):
            unexpected.append(f"{name}: fails {failed}, declares {sorted(impl.known_failures)}")
        by_id = {r.id: r for r in rep.results}
        for rid in failed:
            r = by_id[rid]
            side = "raw" if "-raw-" in name else "adapted"
            key = (framework, side, rid)
            deviations.setdefault(key, []).append((name, r.message, r.repro))
        mb = by_id.get("LOSS-017")
        if mb is None or "blocked by" in mb.message:
            mb_cell = "blocked" + (
                f" ({mb.message.split('blocked by ')[1].split()[0]})" if mb else ""
            )
        elif mb.status is Status.PASS:
            mb_cell = "holds"
        elif mb.status is Status.NOT_APPLICABLE:
            mb_cell = "no counts: " + (
                "depends on the split" if "depends on how" in mb.message else "this split unchanged"
            )
        else:
            mb_cell = f"fails ({mb.status.value})"
        t = tally.setdefault(framework, [0, 0, 0, 0])
        t[0] += 1
        t[1] += not failed
        try:
            s1, l1, s2, l2, how = weights(framework, impl)
            w = f"{_fmt(s1)} / {_fmt(l1)} | {_fmt(s2)} / {_fmt(l2)} | {how}"
            t[3] += 1
            t[2] += not all(abs(a - b) <= 1e-4 * max(abs(a), 1e-8) for a, b in ((s1, s2), (l1, l2)))
        except Exception as e:  # a loss the measurement cannot run: say why
            w = f"– | – | not measured: {type(e).__name__}: {str(e)[:80]}"
        meets = sum(r.passed for r in rep.results)
        blocked = sum(r.blocked for r in rep.results)
        fails = ", ".join(_link(x) for x in failed) if failed else "conforms"
        table.append(
            f"| {framework} | `{name}` | {impl.options.get('aggregation', '')} | {meets} | "
            f"{blocked} | {fails} | {mb_cell} | {w} | {settings(framework, name)} |"
        )
    lines = [
        "# Policy-gradient losses across the field, through the posttrain loss suite",
        "",
        f"Generated by `make losses-report` with torch {metadata.version('torch')}, "
        f"verl {metadata.version('verl')}, TRL {metadata.version('trl')}, OpenRLHF "
        f"{metadata.version('openrlhf')}, TorchRL {metadata.version('torchrl')}, posttrain "
        f"{metadata.version('posttrain')}, on CPU in {time.time() - started:.0f} s.",
        "",
        "Raw rows hand each framework's loss the layout's tensors as they are (only mapped to its "
        "argument names and shapes); adapted rows go through the adapter in "
        "`posttrain/adapters/<framework>/` (values outside the assistant mask zeroed, the batch "
        "validated, global counts mapped to the framework's own arguments where it has them). "
        "The loss math is always the framework's own code: verl's `compute_policy_loss_<mode>` "
        "with its `ActorConfig`, TRL's `GRPOTrainer._compute_loss` on a real trainer, "
        "OpenRLHF's `PolicyLoss` loaded from `openrlhf/models/loss.py` alone.",
        "",
        "Columns: *meets* counts the requirements passed; *blocked* those not run because a "
        "requirement they build on failed (neither passed nor failed: the rest are failed or not "
        "applicable); *settings* lists every framework setting the row runs with that differs "
        "from the framework's default, and the row that runs the default; "
        "*micro-batches* is LOSS-017 (micro-batches given the whole batch's counts add up); the "
        "weights are -d loss_objective / d log p of the first token of a 2-token and of an "
        "8-token answer (a third answer has 5 tokens; advantage 1, ratio 1), in one batch, then "
        "with the 2-token answer in one micro-batch and the other two in another, accumulated "
        "as the last column says. Equal weights in the two settings: micro-batching changes "
        "nothing.",
        "",
        "| framework | rows | conform | gradient changed by micro-batching (of rows measured) |",
        "|---|---|---|---|",
        *[f"| {fw} | {t[0]} | {t[1]} | {t[2]} of {t[3]} |" for fw, t in tally.items()],
        "",
        *_users_table(reports),
        "| framework | row | aggregation | meets | blocked | fails | micro-batches (LOSS-017) | "
        "one batch: short / long | micro-batched: short / long | accumulated as | settings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *table,
        "",
        "## Deviations, with repros",
        "",
        "Each failure once per framework, side and requirement, with the rows it holds for and "
        "a command that reruns it alone (for rows declared in a module, `posttrain check loss "
        "<module>:<ROW>` reruns the whole row).",
        "",
    ]
    for (fw, side, rid), items in sorted(deviations.items()):
        shapes: dict[str, list[tuple[str, str, str]]] = {}
        for it in items:
            shapes.setdefault(_shape(it[1]), []).append(it)
        lines += [f"### {fw} ({side}): {rid}", ""]
        for group in shapes.values():
            names = [n for n, _, _ in group]
            shown = ", ".join(f"`{n}`" for n in names[:6])
            more = f" and {len(names) - 6} more" if len(names) > 6 else ""
            lines += [
                f"- {shown}{more}: {group[0][1]}",
                f"  - repro: `{group[0][2]}`",
            ]
        lines.append("")
    lines += _framework_notes(reports)
    lines += _kit_notes(reports)
    if unexpected:
        lines += ["## Unexpected", "", *[f"- {u}" for u in unexpected], ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "losses.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path, 1 if unexpected else 0


USERS: tuple[tuple[str, str, str], ...] = (
    (
        "posttrain reference",
        "reference-loss-token-mean",
        "`PolicyGradientLoss(counts=GlobalCounts)`: the contract's own plumbing",
    ),
    (
        "NeMo-RL",
        "nemo-rl-loss-token-mean",
        "`global_valid_toks` / `global_valid_seqs` all-reduced by its workers (the port's "
        "`ContractAsNemoLoss` takes them as NeMo-RL's `ClippedPGLossFn.__call__` does)",
    ),
    (
        "TorchRL",
        "torchrl-raw-grpoloss-token-mean",
        "no counts: `GRPOLoss` normalizes by its micro-batch (`_aggregate_loss_value`); users "
        "average the micro-batch losses",
    ),
    (
        "verl",
        "verl-users-vanilla-seq-mean-token-sum-norm",
        "`batch_num_tokens`, `global_batch_size` (`ppo_mini_batch_size x rollout.n`, "
        "`RayPPOTrainer._update_actor`), `dp_size`; `loss_scale_factor` at its default None "
        "(`agg_loss` divides by the tensor's width)",
    ),
    (
        "TRL",
        "trl-users-grpo",
        "`num_items_in_batch` only (`GRPOTrainer._generate_and_score_completions`); `grpo` "
        "and `bnpo` normalize by the micro-batch and divide by the accumulation steps "
        "(`GRPOTrainer._compute_loss`)",
    ),
    ("TRL", "trl-users-bnpo", "as above, `loss_type='bnpo'`"),
    ("TRL", "trl-users-dapo", "as above, `loss_type='dapo'`: divides by `num_items_in_batch`"),
    (
        "OpenRLHF",
        "openrlhf-adapted-ppo-token-mean",
        "`batch_num_tokens` and `global_batch_size` (rows with an action token) all-reduced "
        "by its replay buffer (`openrlhf/trainer/ppo_utils/replay_buffer.py`): the adapted "
        "rows map the same counts",
    ),
)
"""(framework, row, what the framework's own count plumbing passes) under accumulation."""


def _users_table(reports: dict[str, Report]) -> list[str]:
    """One row per framework as its users run it under gradient accumulation: the
    framework's own count plumbing, no posttrain rescaling."""
    lines = [
        "As users run it under gradient accumulation (the framework's own count plumbing, no "
        "posttrain rescaling):",
        "",
        "| framework | row | counts passed | fails |",
        "|---|---|---|---|",
    ]
    for fw, row, how in USERS:
        rep = reports.get(row)
        if rep is None:
            continue
        failed = sorted(rep.failed_ids())
        lines.append(
            f"| {fw} | `{row}` | {how} | "
            f"{', '.join(_link(x) for x in failed) if failed else 'conforms'} |"
        )
    return [*lines, ""]


def _framework_notes(reports: dict[str, Report]) -> list[str]:
    """Why a framework's own defaults fail what they fail, each shown by a witness row."""
    notes = []

    def fails(row: str) -> list[str]:
        rep = reports.get(row)
        return sorted(rep.failed_ids()) if rep else []

    w = "verl-users-vanilla-seq-mean-token-sum-norm"
    if {"LOSS-003", "LOSS-005"} <= set(fails(w)):
        notes.append(
            f"- verl 0.9.1's `seq-mean-token-sum-norm` with `ActorConfig.loss_scale_factor` "
            f"unset (its default) divides by `loss_mask.shape[-1]`, the tensor's width "
            f"(`verl/trainer/ppo/core_algos.py`, `agg_loss`): appending padding columns changes "
            f"the loss (LOSS-005) and a token's weight follows the padded width, not a constant "
            f"(LOSS-003). `{w}` fails {', '.join(fails(w))}; the adapted rows set "
            f"`loss_scale_factor=16` and conform."
        )
    w = "trl-adapted-cispo-default"
    if "LOSS-003" in fails(w):
        notes.append(
            f"- TRL 1.16's cispo weight is `clamp(coef_1, max=self.epsilon_high)` "
            f"(`trl/trainer/grpo_trainer.py`, `GRPOTrainer._compute_loss`): the bound is "
            f"`epsilon_high` itself, not 1 + `epsilon_high`. Unset, `epsilon_high` is `epsilon`, "
            f"0.2 (`GRPOTrainer.__init__`), so every weight at ratio 1 is clamped to 0.2, a "
            f"fifth of the gradient: `{w}` fails {', '.join(fails(w))}. The other cispo rows set "
            f"`epsilon_high=5.0`."
        )
    users = {lt: fails(f"trl-users-{lt}") for lt in ("grpo", "bnpo", "dapo")}
    if users["bnpo"] and not users["dapo"]:
        notes.append(
            "- TRL 1.16 under gradient accumulation, its counts passed only through "
            "`num_items_in_batch`: `dapo` divides by it and conforms; `bnpo` divides by the "
            "micro-batch's own tokens and `grpo` averages the micro-batch's rows (a row "
            "without completion tokens included), each then divided by the accumulation steps "
            f"(`GRPOTrainer._compute_loss`): `trl-users-grpo` fails {', '.join(users['grpo'])}, "
            f"`trl-users-bnpo` fails {', '.join(users['bnpo'])}. The adapted rows pass because "
            "`TRLGRPOLoss` rescales the value by the global counts."
        )
    if not notes:
        return []
    return ["## What the frameworks' defaults do", "", *notes, ""]


def _kit_notes(reports: dict[str, Report]) -> list[str]:
    """Failures the kit's own checks cause on a correct loss, each shown by a witness row."""
    notes = []

    def status(row: str, rid: str) -> Status | None:
        rep = reports.get(row)
        return next((r.status for r in rep.results if r.id == rid), None) if rep else None

    w = "verl-adapted-gpg-token-mean"
    if status(w, "LOSS-016") is Status.FAIL and status(w, "LOSS-017") is Status.PASS:
        notes.append(
            f"- LOSS-016 compares `loss_objective`'s *value* at ratio 1 with the ratio "
            f"surrogate's, -sum(A x w). A loss whose value is -A x log p x w (REINFORCE form: "
            f"verl's gpg, cispo, dro, dppo_*; TRL's cispo and vespo) or a gated surrogate "
            f"(sapo) has the right weights (LOSS-003 and LOSS-017 pass) and fails it. Witness: "
            f"`{w}` (verl's -A log p, token-mean over `batch_num_tokens`)."
        )
    w = "trl-adapted-bnpo"
    if status(w, "LOSS-003") is Status.FAIL and status(w, "LOSS-017") is Status.PASS:
        notes.append(
            f"- LOSS-003 and LOSS-021 read the gradient through a probe on the LM head module's "
            f"output. TRL 1.16 scores tokens through its fused head (`add_fused_lm_head`: the "
            f"head's weight is used directly, no logits), so both report 'no gradient with "
            f"respect to the policy's logits' although the gradient reaches the parameters "
            f"(LOSS-002 and LOSS-017 pass). Witness: `{w}`."
        )
    if not notes:
        return []
    return ["## Failures the kit itself causes", "", *notes, ""]


if __name__ == "__main__":
    path, status = main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/reports"))
    print(path)
    if status:
        print(
            f"{path}: rows failing other than declared (see its 'Unexpected' section)",
            file=sys.stderr,
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if status else 0)
