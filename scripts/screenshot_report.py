"""Render the HTML conformance report of a few bundled rows and screenshot it (the README's image).

Usage: ``.venv/bin/python scripts/screenshot_report.py [--out docs/img/report.png]``

Runs the suites of a handful of registered implementations (a minute on two cores), writes the
page with the same renderer ``posttrain report`` uses, opens it in Debian's headless Chromium
through Playwright (as tests/conformance/test_report_html.py does) and saves the top of the page.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from posttrain.conformance import matrix
from posttrain.conformance.outcome import Report
from posttrain.conformance.runner import run
from posttrain.conformance.target import resolve

ROWS = [
    "reference-buffer",
    "torchrl-raw-lazy-tensor",
    "torchrl-adapted-lazy-tensor",
    "reference-loss-token-mean",
    "nemo-rl-loss-token-mean",
    "torchrl-raw-grpoloss-token-mean",
    "torchrl-adapted-grpoloss-token-mean",
    "reference-metrics-jsonl",
    "torchrl-csv-logger",
]


def main(argv: list[str] | None = None) -> int:
    """Write the screenshot; return the exit status.

    Example:
        >>> main(["--out", "/tmp/report.png"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("docs/img/report.png"))
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1100)
    p.add_argument("rows", nargs="*", default=ROWS, help="entry-point names to run")
    args = p.parse_args(argv)
    chromium = shutil.which("chromium")
    if chromium is None:
        print("expected Debian's chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    reports: dict[str, Report] = {}
    for name in args.rows:
        start = time.perf_counter()
        reports[name] = run(resolve(name), target=name)
        reports[name].run["duration_s"] = round(time.perf_counter() - start, 2)
    with tempfile.TemporaryDirectory() as d:
        page_file = Path(d) / "conformance.html"
        page_file.write_text(matrix.render_html(reports))
        with sync_playwright() as pw:
            # --no-sandbox: Chromium's sandbox refuses to start as root.
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            page.goto(page_file.as_uri())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
