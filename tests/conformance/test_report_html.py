"""The HTML conformance report, rendered from a small real run and opened in headless Chromium.

The browser tests need Debian's ``chromium`` on PATH and the ``playwright`` package (the
``dev`` extra); ``.ci/run`` installs chromium. Without them these tests FAIL, so CI cannot
pass without looking at the page; set ``POSTTRAIN_NO_BROWSER=1`` to skip them instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from posttrain.conformance import matrix
from posttrain.conformance.html_report import failure_kind, render, verdict_of
from posttrain.conformance.outcome import Report, Result, Status
from posttrain.conformance.runner import run
from posttrain.conformance.target import resolve
from posttrain.contracts.registry import get_contract
from tests.mutants import buffers

# Mutants bound to names here, so each row's repro command (module:attr) reruns it.
BROKEN = buffers.MUTANTS["BUF-009"]
"""Zero-fills a missing key (TorchRL's LazyMemmapStorage bug): a MUST failure, undeclared."""
AS_DECLARED = replace(buffers.MUTANTS["BUF-001"], known_failures={"BUF-001"})
"""Fails BUF-001 and declares it; everything after it is blocked."""
WRONGLY_DECLARED = replace(buffers.MUTANTS["BUF-001"], known_failures={"BUF-001", "BUF-002"})
"""Declares BUF-002, which never runs (blocked): an UNEXPECTED row."""
SHOULD_DECLARED = replace(buffers.MUTANTS["BUF-015"], known_failures={"BUF-015"})
"""Fails BUF-015, a SHOULD, and declares it."""

_HERE = "tests.conformance.test_report_html"
TARGETS = [
    "reference-buffer",
    f"{_HERE}:BROKEN",
    f"{_HERE}:AS_DECLARED",
    f"{_HERE}:WRONGLY_DECLARED",
    f"{_HERE}:SHOULD_DECLARED",
    "reference-loss-token-mean",
    "reference-loss-seq-mean-token-mean",
    "nemo-rl-loss-token-mean",
]
NO_BROWSER = os.environ.get("POSTTRAIN_NO_BROWSER") == "1"
OFF_DISK: list[str] = []  # what the page asked for besides its own file


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    return {t: run(resolve(t), target=t) for t in TARGETS}


@pytest.fixture(scope="module")
def page_file(reports: dict[str, Report], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "conformance.html"
    out.write_text(matrix.render_html(reports))
    return out


@pytest.fixture(scope="module")
def browser_page(request: pytest.FixtureRequest) -> Iterator[Any]:
    if NO_BROWSER:
        pytest.skip("POSTTRAIN_NO_BROWSER=1: the browser tests of the HTML report are skipped")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail(
            "opened the HTML report: expected Debian's chromium on PATH, found none "
            "(apt-get install chromium, or set POSTTRAIN_NO_BROWSER=1 to skip)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("opened the HTML report: expected playwright installed (the dev extra)")
    # Only now: the suites' run is the slow part, wasted when there is no browser.
    page_file: Path = request.getfixturevalue("page_file")
    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        # Nothing on the page may need the network: every other request is aborted.
        page.route("**/*", _only_the_file)
        page.on(
            "request", lambda r: None if r.url.startswith("file://") else OFF_DISK.append(r.url)
        )
        page.goto(page_file.as_uri())
        yield page
        browser.close()


@pytest.fixture
def page(browser_page: Any) -> Any:
    # A fresh load per test: no filter left set by another test, in any order.
    browser_page.goto(browser_page.url)
    return browser_page


def _only_the_file(route: Any) -> None:
    if route.request.url.startswith("file://"):
        route.continue_()
    else:
        route.abort()


def _shown_rows(page: Any) -> list[str]:
    names: list[str] = page.eval_on_selector_all(
        "#summary tr[data-row]:not(.hidden)", "els => els.map(e => e.dataset.impl)"
    )
    return names


def test_the_page_renders_a_verdict_per_implementation(page: Any) -> None:
    verdicts = dict(
        zip(
            _shown_rows(page),
            page.eval_on_selector_all(
                "#summary tr[data-row] .v", "els => els.map(e => e.textContent)"
            ),
            strict=True,
        )
    )
    assert verdicts == {
        "reference-buffer": "conforms",
        f"{_HERE}:BROKEN": "does not conform",
        f"{_HERE}:AS_DECLARED": "does not conform (as declared)",
        f"{_HERE}:WRONGLY_DECLARED": "unexpected",
        f"{_HERE}:SHOULD_DECLARED": "conforms with declared deviations",
        "reference-loss-token-mean": "conforms",
        "reference-loss-seq-mean-token-mean": "conforms",
        "nemo-rl-loss-token-mean": "conforms",
    }
    assert page.inner_text("#shown") == "8 of 8 implementations shown"
    unexpected = page.inner_text("#unexpected")
    assert "WRONGLY_DECLARED" in unexpected
    assert "BUF-002 declared a known failure but did not run (blocked)" in unexpected
    assert OFF_DISK == [], "expected a page that needs nothing but itself"
    versions = page.inner_text("#versions")
    for name in ("posttrain", "torch", "torchrl", "trl", "python", "buffer 1.", "loss 1."):
        assert name in versions


def test_the_contract_and_framework_filters_hide_and_show_rows(page: Any) -> None:
    page.select_option("#f-contract", "loss")
    assert _shown_rows(page) == [t for t in TARGETS if "loss" in t]
    assert page.is_hidden(f"[data-row='detail'][data-impl='{_HERE}:BROKEN']")
    assert page.is_hidden("th[data-col='reference-buffer']")
    page.select_option("#f-framework", "nemo_rl")
    assert _shown_rows(page) == ["nemo-rl-loss-token-mean"]
    assert page.inner_text("#shown") == "1 of 8 implementations shown"
    # A contract's own rows stay: its requirements, and its line in the contracts table.
    assert page.is_visible("tr[data-row='matrix'][data-contract='loss']")
    assert page.is_visible("#contracts tr[data-contract='loss']")
    assert page.is_visible("th[data-col='nemo-rl-loss-token-mean']")
    assert page.is_hidden("th[data-col='reference-loss-token-mean']")
    page.select_option("#f-contract", "")
    page.select_option("#f-framework", "tests")
    assert _shown_rows(page) == [t for t in TARGETS if t.startswith(_HERE)]
    page.select_option("#f-framework", "")
    assert len(_shown_rows(page)) == len(TARGETS)
    assert page.is_visible("th[data-col='reference-buffer']")


def test_a_failure_shows_its_message_repro_and_spec_link(page: Any) -> None:
    box = page.locator(f"[data-row='detail'][data-impl='{_HERE}:BROKEN'] .failure")
    assert box.count() == 1
    assert box.inner_text().startswith("BUF-009")
    message = box.locator(".message").inner_text()
    assert message.startswith("BUF-009: ")
    assert "specs/buffer-v1.md#BUF-009" in message
    pytest_repro = box.locator(".repro-pytest").inner_text()
    assert pytest_repro.startswith("pytest ")
    assert f"--conformance-impl={_HERE}:BROKEN" in pytest_repro
    check = page.locator(f"[data-row='detail'][data-impl='{_HERE}:BROKEN'] .repro-check")
    assert check.inner_text() == f"posttrain check buffer {_HERE}:BROKEN"
    assert box.locator("a").get_attribute("href") == "#req-BUF-009"
    # The requirement's own sentence, from the contract object, where the failure cites it.
    text = get_contract("buffer").requirement("BUF-009").text
    assert box.locator(".req-text").inner_text() == text
    assert page.locator("#req-BUF-009 .req-text").inner_text() == text


def test_every_link_resolves_on_the_page_itself(page: Any) -> None:
    hrefs: list[str] = page.eval_on_selector_all(
        "a[href]", "els => els.map(e => e.getAttribute('href'))"
    )
    assert hrefs
    outside = [h for h in hrefs if not h.startswith("#")]
    assert outside == [], f"expected only links to anchors of the page, found {outside[:5]}"
    missing = [h for h in set(hrefs) if page.locator(f"[id='{h[1:]}']").count() != 1]
    assert missing == [], f"expected each link's anchor once on the page, found none for {missing}"
    # Every requirement the matrix cites has its text on the page.
    for contract in ("buffer", "loss"):
        for req in get_contract(contract).requirements:
            assert page.locator(f"#req-{req.id} .req-text").inner_text() == req.text


@pytest.mark.parametrize("width", [700, 1280])
def test_the_page_fits_the_window(page: Any, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    overflow = page.evaluate(
        "() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert overflow[0] <= overflow[1], (
        f"expected no sideways scroll at {width} px, found {overflow}"
    )
    right = page.eval_on_selector("#summary", "e => e.getBoundingClientRect().right")
    assert right <= width, (
        f"expected the verdict table inside {width} px, found its right at {right}"
    )
    # What the summary must show stays visible at both widths.
    for cell in ("td.name", "td.verdict", "td.ids"):
        assert page.is_visible(f"#summary tr[data-impl='{_HERE}:BROKEN'] {cell}")
    page.set_viewport_size({"width": 1280, "height": 720})


def test_blocked_and_should_failures_look_different_from_must_failures(page: Any) -> None:

    def background(selector: str) -> str:
        colour: str = page.eval_on_selector(selector, "e => getComputedStyle(e).background")
        return colour

    row = f"[data-row='detail'][data-impl='{_HERE}:AS_DECLARED']"
    must = background(f"{row} .failure[data-req='BUF-001']")
    blocked = background(f"{row} .failure[data-req='BUF-002']")
    should = background(f"[data-impl='{_HERE}:SHOULD_DECLARED'] .failure[data-req='BUF-015']")
    assert len({must, blocked, should}) == 3
    assert page.inner_text(f"{row} .failure[data-req='BUF-002'] .tag >> nth=1") == "blocked"
    cell = f"td[data-col='{_HERE}:AS_DECLARED'].k-blocked"
    assert page.locator(cell).first.inner_text() == "blocked"


def test_every_message_is_escaped() -> None:
    evil = "<script>alert(1)</script>"
    row = Result("BUF-013", "MUST", "empty sample raises", Status.FAIL, f"BUF-013: {evil}")
    rep = Report(run={"contract": "buffer", "contract_version": "1.0"}, results=[row])
    page = render({f"x{evil}": rep}, {f"x{evil}": evil})
    assert evil not in page
    assert page.count("<script>") == 1  # the page's own


def test_failure_kinds_and_verdicts() -> None:
    rows = [
        Result("BUF-001", "MUST", "t", Status.FAIL, "BUF-001: x"),
        Result("BUF-002", "MUST", "t", Status.FAIL, "BUF-002: blocked by BUF-001"),
        Result("BUF-015", "SHOULD", "t", Status.FAIL, "BUF-015: x"),
        Result("BUF-003", "MUST", "t", Status.ERROR, "BUF-003: raised"),
        Result("BUF-024", "SHOULD", "t", Status.ERROR, "BUF-024: raised"),
        Result("BUF-016", "MUST", "t", Status.NOT_APPLICABLE, "n/a"),
    ]
    kinds = [failure_kind(r) for r in rows]
    assert kinds == ["must", "blocked", "should", "error", "should", "na"]
    assert verdict_of(Report(run={"known_failures": ["BUF-015"]}, results=[rows[2]])) == (
        "conforms with declared deviations"
    )
