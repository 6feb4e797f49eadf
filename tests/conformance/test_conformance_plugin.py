"""The pytest plugin end to end (pytester): options, exit status, reports, errors."""

from __future__ import annotations

import json

import pytest

from posttrain.contracts import get_contract

pytest_plugins = ["pytester"]

REF = "posttrain.reference_impls:RING_BUFFER"


def test_reference_passes_from_an_empty_directory(pytester: pytest.Pytester) -> None:
    report = pytester.path / "out" / "buffer.json"
    res = pytester.runpytest_inprocess(
        "--conformance=buffer", f"--conformance-impl={REF}", f"--conformance-report={report}"
    )
    res.assert_outcomes(passed=20, skipped=5)
    assert res.ret == 0
    res.stdout.fnmatch_lines(
        [
            "posttrain conformance: posttrain.RingBuffer (*) against buffer v1.6; capabilities: checkpoint, read, thread_safe*",
            "BUF-009   MUST   PASS           missing key rejected atomically",
            "*20 PASS, 0 FAIL, 0 ERROR, 5 NOT_APPLICABLE; verdict: conforms*",
        ]
    )
    data = json.loads(report.read_text())
    assert data["format"] == "posttrain-conformance-report/1"
    (rep,) = data["reports"]
    assert rep["verdict"] == "conforms"
    assert rep["run"]["implementation"] == "posttrain.RingBuffer"
    assert rep["run"]["contract_version"] == get_contract("buffer").version
    assert {"torch", "tensordict", "posttrain"} <= set(rep["run"]["versions"])
    rows = {r["id"]: r for r in rep["results"]}
    assert rows["BUF-020"]["status"] == "NOT_APPLICABLE"
    assert "-k BUF-020" in rows["BUF-020"]["repro"]
    assert (
        "| BUF-001 | MUST | extend returns indices | PASS |"
        in report.with_suffix(".md").read_text()
    )


def test_zero_filling_buffer_fails_buf009(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        port="""
        from tests.mutants.buffers import MUTANTS
        IMPL = MUTANTS["BUF-009"]
        """
    )
    res = pytester.runpytest_inprocess(
        "--conformance=buffer", "--conformance-impl=port:IMPL", "-k", "BUF-009"
    )
    assert res.ret == 1
    res.assert_outcomes(failed=1, deselected=24)
    res.stdout.fnmatch_lines(
        [
            "*FAIL BUF-009: extend with key ('masks', 'all_attention_mask') missing: was accepted*",
            "*repro: pytest*-k BUF-009*",
        ]
    )


def test_plain_factory_and_entry_point(pytester: pytest.Pytester) -> None:
    res = pytester.runpytest_inprocess(
        "--conformance=buffer", "--conformance-impl=posttrain.reference_impls:make_ring_buffer"
    )
    res.assert_outcomes(passed=15, skipped=10)  # no capabilities declared
    res = pytester.runpytest_inprocess(
        "--conformance=buffer", "--conformance-impl=reference-buffer", "-k", "BUF-01"
    )
    assert res.ret == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--conformance=bufer", f"--conformance-impl={REF}"],
            "unknown contract 'bufer'; known contracts: buffer, rollout",
        ),
        (["--conformance=buffer"], "--conformance needs --conformance-impl"),
        (
            ["--conformance=buffer", "--conformance-impl=nope"],
            "'nope' is neither 'module:attr' nor an entry point",
        ),
        (["--conformance=loss", f"--conformance-impl={REF}"], "implements 'buffer', not 'loss'"),
        (
            ["--conformance=buffer", "--conformance-impl=posttrain:__version__"],
            "expected a posttrain Implementation or a factory callable",
        ),
    ],
)
def test_usage_errors(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    res = pytester.runpytest_inprocess(*args)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert message in res.stderr.str()


def test_list_prints_the_catalogue(pytester: pytest.Pytester) -> None:
    res = pytester.runpytest_inprocess("--conformance-list", "--conformance=buffer")
    assert res.ret == 0
    res.stdout.fnmatch_lines(
        [
            "buffer v1.6 — Replay buffer",
            "  BUF-001 MUST   extend returns indices",
            "  BUF-017 MUST   priorities steer sampling [capability priority]",
        ]
    )


def test_inert_without_options(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    assert True\n")
    res = pytester.runpytest_inprocess()
    res.assert_outcomes(passed=1)
    assert "posttrain conformance" not in res.stdout.str()


def test_every_registered_entry_point_is_an_implementation() -> None:
    from posttrain.conformance import discover
    from posttrain.contracts.implementation import Implementation

    eps = discover()
    assert {"reference-buffer", "reference-loss-token-mean"} <= set(eps)
    for name, ep in eps.items():
        assert isinstance(ep.load(), Implementation), name


def test_two_contracts_in_one_run(pytester: pytest.Pytester) -> None:
    report = pytester.path / "r.json"
    res = pytester.runpytest_inprocess(
        "--conformance=buffer,loss",
        "--conformance-impl=reference-buffer",
        "--conformance-impl=reference-loss-seq-mean-token-sum",
        f"--conformance-report={report}",
    )
    assert res.ret == 0
    # loss: LOSS-019/020/021/022/023 need a declared option the reference row does not declare
    # loss: the reference declares no KL or ratio option, so LOSS-019/020/021 check the defaults
    res.assert_outcomes(passed=20 + 21, skipped=5 + 3)
    data = json.loads(report.read_text())["reports"]
    assert [d["run"]["contract"] for d in data] == ["buffer", "loss"]
    assert data[1]["run"]["options"] == {  # declared, then the contract's defaults
        "aggregation": "seq_mean_token_sum",
        "kl_estimator": "k3",
        "kl_gradient": "pathwise",
        "ratio": "token",
    }


@pytest.mark.parametrize(
    "name", ["reference-rollout-hf", "reference-weight-sync", "reference-metrics-jsonl"]
)
def test_other_references_pass_through_pytest(pytester: pytest.Pytester, name: str) -> None:
    contract = {
        "reference-rollout-hf": "rollout",
        "reference-weight-sync": "weight_sync",
        "reference-metrics-jsonl": "metrics",
    }[name]
    res = pytester.runpytest_inprocess(f"--conformance={contract}", f"--conformance-impl={name}")
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*conforms (every MUST)*"])
