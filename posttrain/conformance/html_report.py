"""The conformance matrix as one self-contained HTML page (``reports/conformance.html``).

Inline CSS and JavaScript only, nothing fetched: the page works opened from disk, offline,
moved or mailed. Each requirement's text comes from the contract objects and sits on the page
(section "Requirements"); every link is to an anchor of the page itself. The page fits a
700 px wide window: wide tables scroll inside their own box.
Every string that comes from an implementation under test (names, messages) is escaped.
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Mapping

from posttrain.conformance.outcome import Report, Result, Status, retry_note
from posttrain.contracts.registry import CONTRACTS

VERDICTS: dict[str, str] = {
    "conforms": "every requirement holds",
    "conforms with declared deviations": "every MUST holds; the SHOULD failures are declared",
    "conforms, SHOULD failing": (
        "every MUST holds; a SHOULD failed and nothing was declared (a SHOULD never fails a run)"
    ),
    "does not conform (as declared)": "fails exactly the declared MUST requirements",
    "does not conform": "a MUST or SHOULD failed and nothing was declared",
    "unexpected": "the failures differ from the declared known failures",
}
"""Each verdict the page shows, with what it means (its legend)."""

_VERSIONED = ("posttrain", "torch", "torchrl", "trl", "tensordict", "transformers")


def verdict_of(rep: Report) -> str:
    """One of :data:`VERDICTS`: :meth:`Report.verdict`, with declared SHOULD-only deviations apart.

    Example:
        >>> verdict_of(Report(run={}, results=[]))
        'conforms'
        >>> r = Result("MET-007", "SHOULD", "t", Status.FAIL, "MET-007: x")
        >>> verdict_of(Report(run={"known_failures": ["MET-007"]}, results=[r]))
        'conforms with declared deviations'
    """
    verdict = rep.verdict()
    if verdict == "conforms" and rep.failed_ids():
        return "conforms with declared deviations"
    return verdict


def failure_kind(r: Result) -> str:
    """How a row reads: ``pass``, ``na``, ``blocked``, ``should``, ``error`` or ``must``.

    ``blocked``: not run, a requirement it depends on failed; ``should``: a SHOULD that failed
    or errored (never blocking); ``error``: a MUST whose check raised; ``must``: a MUST that
    failed.

    Example:
        >>> failure_kind(Result("BUF-016", "MUST", "t", Status.FAIL, "BUF-016: blocked by BUF-009"))
        'blocked'
    """
    if r.status is Status.PASS:
        return "pass"
    if r.status is Status.NOT_APPLICABLE:
        return "na"
    if r.blocked:
        return "blocked"
    if r.level == "SHOULD":
        return "should"
    return "error" if r.status is Status.ERROR else "must"


def cell_label(r: Result) -> str:
    """What a row's cell says, in every format: ``PASS``, ``n/a``, ``blocked``, ``ERROR``,
    ``FAIL`` (a MUST), ``FAIL (SHOULD)`` or ``ERROR (SHOULD)``.

    Example:
        >>> cell_label(Result("BUF-016", "MUST", "t", Status.FAIL, "BUF-016: blocked by BUF-009"))
        'blocked'
    """
    k = failure_kind(r)
    if k == "should":
        return f"{r.status.value} (SHOULD)"
    return _LABEL[k]


def left_out_sentence(names: list[str]) -> str:
    """The line a report of the in-process rows carries about the rows it leaves out.

    Example:
        >>> left_out_sentence(["ray-served-reference-buffer"])
        '1 row that starts Ray or torch.distributed is not here: `make report-distributed` runs it (ray-served-reference-buffer).'
    """
    one = len(names) == 1
    return (
        f"{len(names)} row{'' if one else 's'} that start{'s' if one else ''} Ray or "
        f"torch.distributed {'is' if one else 'are'} not here: `make report-distributed` runs "
        f"{'it' if one else 'them'} ({', '.join(names)})."
    )


_LABEL = {
    "pass": "PASS",
    "na": "n/a",
    "blocked": "blocked",
    "error": "ERROR",
    "should": "FAIL (SHOULD)",
    "must": "FAIL",
}

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:110em}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ccc}
.meta{color:#555;font-size:.9em}
table{border-collapse:collapse;margin:.6em 0}
td,th{border:1px solid #bbb;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
code,pre{font-family:ui-monospace,monospace;font-size:.9em}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:.2em 0;background:#f7f7f7;padding:4px 6px}
code{overflow-wrap:anywhere}
.filters{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #ddd;z-index:1}
.filters label{margin-right:1.5em}
.hidden{display:none}
.v{display:inline-block;padding:1px 8px;border-radius:9px;font-weight:600}
.v-conforms{background:#c8f0c5}
.v-deviations{background:#e3f5c0}
.v-declared{background:#f3e2b8}
.v-fails{background:#f5b5b5}
.v-unexpected{background:#7a1212;color:#fff}
td.k-pass{background:#c8f0c5}
td.k-na{background:#eee;color:#777}
td.k-must{background:#f5b5b5;font-weight:600}
td.k-should{background:#fbe7b0;border-style:dashed}
td.k-blocked,.failure.k-blocked{background:repeating-linear-gradient(45deg,#f4f4f4,#f4f4f4 4px,#e6e6e6 4px,#e6e6e6 8px);color:#666}
td.k-error{background:#f7cba0;font-weight:600}
.failure.k-must{background:#fdeeee}
.failure.k-should{background:#fdf6e0}
.failure.k-error{background:#fdf0e4}
.matrix th[data-col]{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;font-size:.85em;font-weight:500;text-align:left}
.matrix td[data-col]{white-space:nowrap;font-size:.9em}
.scroll{overflow-x:auto;max-width:100%}
.req{margin:.4em 0;padding:.2em .6em;border-left:3px solid #bbb}
.req:target{background:#fff7c0}
.req-text{margin:.2em 0 .3em;color:#333}
.retry{font-size:.8em;padding:0 5px;border:1px dashed #7a1212;border-radius:4px;margin-left:.4em}
.unexpected{border:2px solid #7a1212;padding:0 1em;background:#fff4f4}
.unexpected.none{border-color:#7bb276;background:#f4fbf3}
.unexpected h2{margin-top:.5em;border:0}
.failure{margin:.5em 0 .9em;padding:.3em .6em;border-left:5px solid #c33}
.failure.k-should{border-left-color:#d9a300}
.failure.k-blocked{border-left-color:#999;margin:.15em 0;padding:.1em .6em;font-size:.9em}
.failure.k-error{border-left-color:#e07b00}
#summary{font-size:.92em} #summary th{white-space:nowrap}
#summary td.name{width:20em;overflow-wrap:anywhere}
#summary td.verdict,#summary td:nth-child(2){white-space:nowrap}
td.ids{width:13em} .id{white-space:nowrap}
.tag{font-size:.8em;padding:0 5px;border:1px solid #999;border-radius:4px;margin-left:.4em}
/* Narrow windows: the counts columns go (the failed ids stay), long cells wrap. */
@media (max-width:900px){
 body{margin:.6em;overflow-wrap:anywhere}
 #summary th:nth-child(n+6),#summary td:nth-child(n+6){display:none}
 #summary td.name{width:auto} #summary td.ids{width:auto}
 #summary td.verdict,#summary td:nth-child(2){white-space:normal}
 #summary td:nth-child(2),#summary td:nth-child(3){overflow-wrap:normal}
 .filters label{margin-right:.6em;display:inline-block}
}
"""

_JS = """
function applyFilters(){
  var c=document.getElementById('f-contract').value, f=document.getElementById('f-framework').value;
  var shown={}, n=0, total=0;
  document.querySelectorAll('[data-row]').forEach(function(el){
    // Rows of a contract (the requirement matrix, the contracts table) have no framework.
    var ok=(!c||el.dataset.contract===c)&&(!f||el.dataset.framework===undefined||el.dataset.framework===f);
    el.classList.toggle('hidden',!ok);
    if(el.dataset.row==='summary'){total++; if(ok){n++; shown[el.dataset.impl]=1;}}
  });
  document.querySelectorAll('[data-col]').forEach(function(el){
    el.classList.toggle('hidden',!shown[el.dataset.col]);
  });
  document.querySelectorAll('[data-section]').forEach(function(el){
    var any=el.querySelector('[data-row]:not(.hidden)');
    el.classList.toggle('hidden',!any);
  });
  document.getElementById('shown').textContent=n+' of '+total+' implementations shown';
}
document.addEventListener('DOMContentLoaded',function(){
  ['f-contract','f-framework'].forEach(function(id){
    document.getElementById(id).addEventListener('change',applyFilters);
  });
  applyFilters();
});
"""

_VERDICT_CLASS = {
    "conforms": "v-conforms",
    "conforms with declared deviations": "v-deviations",
    "conforms, SHOULD failing": "v-deviations",
    "does not conform (as declared)": "v-declared",
    "does not conform": "v-fails",
    "unexpected": "v-unexpected",
}


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _anchor(name: str) -> str:
    return "impl-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def _row_attrs(name: str, rep: Report, framework: str, kind: str) -> str:
    return (
        f" data-row='{kind}' data-impl='{_e(name)}' "
        f"data-contract='{_e(rep.run.get('contract', '?'))}' data-framework='{_e(framework)}'"
    )


def _versions(reports: Mapping[str, Report]) -> str:
    seen: dict[str, set[str]] = {}
    for rep in reports.values():
        for dist, v in rep.run.get("versions", {}).items():
            seen.setdefault(dist, set()).add(str(v))
        if rep.run.get("python"):
            seen.setdefault("python", set()).add(str(rep.run["python"]))
    order = [*_VERSIONED, "python"]
    names = [d for d in order if d in seen] + sorted(d for d in seen if d not in order)
    for d in ("torchrl", "trl"):
        if d not in seen:
            names.append(d)
    items = [
        f"{_e(d)} <code>{_e(', '.join(sorted(seen[d])) if d in seen else 'not installed')}</code>"
        for d in names
    ]
    contracts = sorted(
        {
            f"{rep.run.get('contract', '?')} {rep.run.get('contract_version', '?')}"
            for rep in reports.values()
        }
    )
    items.append("contracts " + _e(", ".join(contracts)))
    return " · ".join(items)


def _ids(ids: list[str], limit: int = 10) -> str:
    more = f" ... and {len(ids) - limit} more" if len(ids) > limit else ""
    return " ".join(f"<span class='id'>{_e(i)}</span>" for i in ids[:limit]) + more


def _req_anchor(rid: str) -> str:
    return "req-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in rid)


def requirement_text(contract: str, rid: str) -> str:
    """The normative sentence of requirement ``rid`` of ``contract``, or ``""`` if unknown.

    Example:
        >>> requirement_text("buffer", "BUF-013").startswith("`sample")
        True
    """
    c = CONTRACTS.get(contract)
    if c is None:
        return ""
    try:
        return c.requirement(rid).text
    except KeyError:
        return ""


def _contracts_table(reports: Mapping[str, Report]) -> list[str]:
    contracts: dict[str, set[str]] = {}
    for rep in reports.values():
        contracts.setdefault(str(rep.run.get("contract", "?")), set()).add(
            str(rep.run.get("contract_version", "?"))
        )
    out = [
        "<table id='contracts'><tr><th>contract</th><th>version</th>"
        "<th>requirements</th><th>spec file</th></tr>"
    ]
    for c, versions in contracts.items():
        spec = next(
            (
                r.spec.split("#")[0]
                for rep in reports.values()
                if rep.run.get("contract") == c
                for r in rep.results
                if r.spec
            ),
            "",
        )
        # The spec file is named, not linked: `posttrain specs DIR` writes it from any install.
        out.append(
            f"<tr data-row='contract' data-contract='{_e(c)}'><td>{_e(c)}</td>"
            f"<td>{_e(', '.join(sorted(versions)))}</td>"
            f"<td><a href='#{_e(_contract_anchor(c))}'>on this page</a></td>"
            f"<td><code>{_e(spec)}</code></td></tr>"
        )
    out.append("</table>")
    return out


def _contract_anchor(contract: str) -> str:
    return "contract-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in contract)


def _requirements(reports: Mapping[str, Report]) -> list[str]:
    """Each cited requirement's sentence, by contract: what every link on the page points to."""
    by_contract: dict[str, dict[str, Result]] = {}
    for rep in reports.values():
        rows = by_contract.setdefault(str(rep.run.get("contract", "?")), {})
        for r in rep.results:
            rows.setdefault(r.id, r)
    out = ["<h2>Requirements</h2>"]
    for contract, rows in by_contract.items():
        out.append(
            f"<section id='{_e(_contract_anchor(contract))}' data-section='requirements' "
            f"data-contract='{_e(contract)}'><h3>{_e(contract)}</h3>"
        )
        for rid, r in rows.items():
            text = requirement_text(contract, rid) or r.title
            out.append(
                f"<div class='req' id='{_e(_req_anchor(rid))}' data-row='requirement' "
                f"data-contract='{_e(contract)}'><b>{_e(rid)}</b> <small>{_e(r.level)}</small> "
                f"{_e(r.title)}<p class='req-text'>{_e(text)}</p></div>"
            )
        out.append("</section>")
    return out


def _summary(reports: Mapping[str, Report], frameworks: Mapping[str, str]) -> list[str]:
    out = [
        "<table id='summary'><tr><th>implementation</th><th>contract</th><th>framework</th>"
        "<th>verdict</th><th>failed</th><th>PASS</th><th>FAIL</th><th>ERROR</th><th>n/a</th><th>time (s)</th></tr>"
    ]
    for name, rep in reports.items():
        fw = frameworks.get(name, "?")
        v = verdict_of(rep)
        c = rep.counts()
        out.append(
            f"<tr{_row_attrs(name, rep, fw, 'summary')} data-verdict='{_e(v)}'>"
            f"<td class='name'><a href='#{_anchor(name)}'>{_e(name)}</a><br><small>{_e(rep.run.get('implementation', ''))}</small></td>"
            f"<td>{_e(rep.run.get('contract', '?'))} v{_e(rep.run.get('contract_version', '?'))}</td>"
            f"<td>{_e(fw)}</td>"
            f"<td class='verdict'><span class='v {_VERDICT_CLASS[v]}'>{_e(v)}</span>{_retry_tag(rep)}</td>"
            f"<td class='ids'>{_ids(sorted(rep.failed_ids()))}</td>"
            f"<td>{c['PASS']}</td><td>{c['FAIL']}</td><td>{c['ERROR']}</td><td>{c['NOT_APPLICABLE']}</td>"
            f"<td>{_e(rep.run.get('duration_s', ''))}</td></tr>"
        )
    out.append("</table>")
    return out


def _retry_tag(rep: Report) -> str:
    note = retry_note(rep)
    return f"<span class='retry' title='{_e(note)}'>retried</span>" if note else ""


def _unexpected(reports: Mapping[str, Report], frameworks: Mapping[str, str]) -> list[str]:
    rows = [(n, rep) for n, rep in reports.items() if rep.surprises()]
    cls = "unexpected" if rows else "unexpected none"
    out = [f"<section id='unexpected' class='{cls}'><h2>Unexpected ({len(rows)})</h2>"]
    if not rows:
        out.append("<p>None: every implementation fails exactly what it declares (or nothing).</p>")
    else:
        out.append(
            "<p>A failure that is not declared in the implementation's <code>known_failures</code>, "
            "or a declared one that now passes.</p><ul>"
        )
        for name, rep in rows:
            fw = frameworks.get(name, "?")
            items = "".join(f"<li>{_e(s)}</li>" for s in rep.surprises())
            out.append(
                f"<li{_row_attrs(name, rep, fw, 'unexpected')}><a href='#{_anchor(name)}'><b>{_e(name)}</b></a> "
                f"({_e(rep.run.get('contract', '?'))}, {_e(fw)})<ul>{items}</ul></li>"
            )
        out.append("</ul>")
    out.append("</section>")
    return out


def _matrix(reports: Mapping[str, Report], frameworks: Mapping[str, str]) -> list[str]:
    by_contract: dict[str, list[str]] = {}
    for name, rep in reports.items():
        by_contract.setdefault(str(rep.run.get("contract", "?")), []).append(name)
    out = ["<h2>Requirements by contract</h2>"]
    for contract, names in by_contract.items():
        out.append(
            f"<section data-section='matrix' data-contract='{_e(contract)}'>"
            f"<h3>{_e(contract)}</h3><div class='scroll'><table class='matrix'><tr><th>requirement</th>"
        )
        out += [f"<th data-col='{_e(n)}'>{_e(n)}</th>" for n in names]
        out.append("</tr>")
        by_id = {n: {r.id: r for r in reports[n].results} for n in names}
        ids: dict[str, Result] = {}
        for n in names:
            for rid, r in by_id[n].items():
                ids.setdefault(rid, r)
        for rid, head in ids.items():
            text = requirement_text(contract, rid)
            out.append(
                f"<tr data-row='matrix' data-contract='{_e(contract)}'>"
                f"<td title='{_e(text)}'><a href='#{_e(_req_anchor(rid))}'>{_e(rid)}</a> "
                f"<small>{_e(head.level)}</small> {_e(head.title)}</td>"
            )
            for n in names:
                cell = by_id[n].get(rid)
                if cell is None:
                    out.append(f"<td data-col='{_e(n)}'></td>")
                    continue
                k = failure_kind(cell)
                out.append(
                    f"<td data-col='{_e(n)}' class='k-{k}' title='{_e(cell.message)}'>{_e(cell_label(cell))}</td>"
                )
            out.append("</tr>")
        out.append("</table></div></section>")
    return out


def _details(reports: Mapping[str, Report], frameworks: Mapping[str, str]) -> list[str]:
    out = ["<h2>Failures by implementation</h2>"]
    for name, rep in reports.items():
        fw = frameworks.get(name, "?")
        contract = str(rep.run.get("contract", "?"))
        v = verdict_of(rep)
        known = set(rep.run.get("known_failures", []))
        bad = [r for r in rep.results if r.status in (Status.FAIL, Status.ERROR)]
        out.append(
            f"<div id='{_anchor(name)}' class='impl'{_row_attrs(name, rep, fw, 'detail')}>"
            f"<h3>{_e(name)} <span class='v {_VERDICT_CLASS[v]}'>{_e(v)}</span></h3>"
            f"<p class='meta'>{_e(rep.run.get('implementation', ''))} — {_e(contract)} "
            f"v{_e(rep.run.get('contract_version', '?'))}, framework {_e(fw)}; capabilities: "
            f"{_e(', '.join(rep.run.get('capabilities', [])) or 'none')}; declared known failures: "
            f"{_e(', '.join(sorted(known)) or 'none')}; seed {_e(rep.run.get('seed', '?'))}</p>"
            f"<p>Rerun: <code class='repro-check'>posttrain check {_e(contract)} {_e(name)}</code></p>"
        )
        note = retry_note(rep)
        if note:
            out.append(f"<p class='retry-note'><span class='retry'>retried</span> {_e(note)}</p>")
        if not bad:
            out.append("<p>No failures.</p></div>")
            continue
        for r in bad:
            k = failure_kind(r)
            link = f"<a href='#{_e(_req_anchor(r.id))}'>{_e(r.id)}</a>"
            tags = f"<span class='tag'>{_e(r.level)}</span><span class='tag'>{_e(cell_label(r))}</span>"
            if r.id in known:
                tags += "<span class='tag'>declared</span>"
            pytest_line = (
                f"<div>pytest: <code class='repro-pytest'>{_e(r.repro)}</code></div>"
                if r.repro.startswith("pytest")
                else f"<div class='meta'>{_e(r.repro)}</div>"
                if r.repro
                else ""
            )
            head = f"<div class='failure k-{k}' data-req='{_e(r.id)}'><b>{link}</b> {_e(r.title)}{tags}"
            if k == "blocked":
                # Not run: one line, the failed foundation says the rest.
                out.append(f"{head} <span class='message'>{_e(r.message)}</span></div>")
                continue
            text = requirement_text(contract, r.id)
            quote = f"<p class='req-text'>{_e(text)}</p>" if text else ""
            out.append(
                f"{head}{quote}<pre class='message'>{_e(r.message)}</pre>{pytest_line}</div>"
            )
        out.append("</div>")
    return out


def _select(ident: str, label: str, values: list[str]) -> str:
    opts = "".join(f"<option value='{_e(v)}'>{_e(v)}</option>" for v in values)
    return f"<label>{_e(label)} <select id='{ident}'><option value=''>all</option>{opts}</select></label>"


def render(
    reports: Mapping[str, Report],
    frameworks: Mapping[str, str] | None = None,
    *,
    title: str = "posttrain conformance report",
    left_out: list[str] | None = None,
) -> str:
    """The whole page: unexpected rows on top, filters, verdicts, requirement matrix, failures.

    ``reports`` by implementation name (an entry-point name or ``module:attr``: it goes into
    each repro command); ``frameworks`` by the same names; ``left_out`` names the rows another
    command runs (:func:`left_out_sentence`).

    Example:
        >>> row = Result("BUF-013", "MUST", "empty sample raises", Status.FAIL, "BUF-013: <no error>")
        >>> rep = Report(run={"contract": "buffer", "contract_version": "1.0"}, results=[row])
        >>> page = render({"mine": rep}, {"mine": "posttrain"})
        >>> "does not conform" in page, "BUF-013: &lt;no error&gt;" in page, "<no error>" in page
        (True, True, False)
    """
    frameworks = dict(frameworks or {})
    contracts = sorted({str(rep.run.get("contract", "?")) for rep in reports.values()})
    fws = sorted({frameworks.get(n, "?") for n in reports})
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    legend = "".join(
        f"<li><span class='v {_VERDICT_CLASS[v]}'>{_e(v)}</span> {_e(m)}</li>"
        for v, m in VERDICTS.items()
    )
    cells = "".join(
        f"<td class='k-{k}'>{_e(_LABEL[k])}</td>"
        for k in ("pass", "must", "should", "blocked", "error", "na")
    )
    parts: list[str] = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p class='meta' id='versions'>Generated {_e(now)} · {_versions(reports)}</p>",
        f"<p id='left-out'>{_e(left_out_sentence(left_out))}</p>" if left_out else "",
        *_unexpected(reports, frameworks),
        "<div class='filters'>",
        _select("f-contract", "contract", contracts),
        _select("f-framework", "framework", fws),
        "<span id='shown' class='meta'></span></div>",
        "<h2>Verdicts</h2>",
        *_summary(reports, frameworks),
        f"<details><summary>Legend</summary><ul>{legend}</ul>"
        f"<table><tr>{cells}</tr></table><p>FAIL is a MUST that failed; FAIL (SHOULD) a "
        "SHOULD that failed (never blocking); blocked: not run because a requirement it "
        "depends on failed; ERROR: the check raised unexpectedly.</p></details>",
        "<h2>Contracts</h2>",
        *_contracts_table(reports),
        *_matrix(reports, frameworks),
        *_details(reports, frameworks),
        *_requirements(reports),
        f"<script>{_JS}</script></body></html>\n",
    ]
    return "\n".join(parts)
