"""The dashboard page: server-rendered HTML with inline SVG charts, no external asset.

Every string that came from a peer goes through :func:`~.charts.text` (control and bidi characters dropped,
HTML-escaped), and the page's Content-Security-Policy allows only this module's own inline script
and style (by hash), so even a missed escape could not run script.
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Any
from urllib.parse import quote

from diloco_swarm.dashboard.charts import (
    PALETTE_SIZE, fmt_bytes, fmt_duration, fmt_float, fmt_held_out, fmt_si, legend, line_chart, short_id, text,
)

def avoided_text(entry: dict[str, Any]) -> str:
    """One entry of ``totals.avoided`` (``state.avoided_summary``) in words, as plain text (peer-supplied:
    escape or sanitize it for the screen): ``avoided by 2 of 4 peers (alice, 3f9a2c…e0b1d4): its Δ was an
    outlier in 3 rounds in a row``."""
    by = entry.get("by") or []
    who = ", ".join(str(b.get("name") or short_id(b.get("peer_id"))) for b in by)
    why = "; ".join(str(w) for w in entry.get("why") or [])
    return f"avoided by {len(by)} of {entry.get('of', len(by))} peers ({who})" + (f": {why}" if why else "")


# ------------------------------------------------------------------------------------------ page
MAX_CHART_PEERS = 8  # lines per chart besides the swarm's; the rest are summed in the swarm line


def _charted(doc: dict[str, Any]) -> dict[str, int]:
    """Peers that get a line (table order: online first), each with its own palette slot."""
    peer_hist = (doc.get("history") or {}).get("peers") or {}
    chosen = [r for r in doc["peers"] if r["owner"] in peer_hist][:MAX_CHART_PEERS]
    chosen.sort(key=lambda r: (r.get("first_seen") or 0, r["owner"]))
    return {r["owner"]: i % PALETTE_SIZE for i, r in enumerate(chosen)}


def _label(row: dict[str, Any]) -> str:
    return row.get("name") or short_id(row.get("peer_id"))


def _charts(doc: dict[str, Any], colors: dict[str, int], now: float) -> str:
    hist = doc.get("history") or {}
    swarm = hist.get("swarm") or {}
    peer_hist = hist.get("peers") or {}
    rows = {r["owner"]: r for r in doc["peers"]}
    loss_series, tps_series = [], []
    for owner in colors:
        row, cols = rows[owner], peer_hist[owner]
        t = cols.get("t", [])
        loss_series.append({"label": _label(row), "color": colors[owner], "points": list(zip(t, cols.get("loss", [])))})
        tps_series.append({"label": _label(row), "color": colors[owner],
                           "points": list(zip(t, cols.get("tokens_per_s", [])))})
    st = swarm.get("t", [])
    loss_series.append({"label": "swarm mean", "color": "total", "main": True,
                        "points": list(zip(st, swarm.get("mean_loss", [])))})
    tps_series.append({"label": "swarm total", "color": "total", "main": True,
                       "points": list(zip(st, swarm.get("tokens_per_s", [])))})
    loss = line_chart(loss_series, title="Training loss over time", now=now, unit_fmt=lambda v: f"{v:.3g}")
    tps = line_chart(tps_series, title="Tokens per second over time", now=now, zero_based=True)
    return (
        '<section class="charts">'
        f'<figure class="card" id="chart-loss"><figcaption>Loss</figcaption>{loss}{legend(loss_series)}</figure>'
        f'<figure class="card" id="chart-tps"><figcaption>Tokens / s</figcaption>{tps}{legend(tps_series)}</figure>'
        "</section>"
    )


def _totals(doc: dict[str, Any]) -> str:
    t = doc["totals"]
    cards = [
        ("peers-online", "Peers online", str(t["peers_online"]), f'{t["peers_stale"]} stale · {t["peers_gone"]} gone'),
        ("tokens-per-s", "Tokens / s", fmt_si(t["tokens_per_s"]), "sum over online peers"),
        ("outer-step", "Newest outer step", "–" if t["newest_outer_step"] is None else str(t["newest_outer_step"]),
         f'{t["failed_rounds"]} failed rounds'),
        ("mean-loss", "Mean loss", fmt_float(t["mean_loss"]), fmt_held_out(t["mean_eval_loss"], t.get("eval_outer_steps"))),
        ("tokens-total", "Tokens trained", fmt_si(t["tokens_total"]), "by the listed peers"),
        ("lineages", "θ lineages", "–" if t["lineages"] is None else str(t["lineages"]), _lineage_note(t)),
    ]
    if t.get("refused"):  # a private run: records of peers without a valid invitation, left out of everything
        cards.append(("refused", "Refused peers", str(t["refused"]), "no valid invitation"))
    return '<section class="totals">' + "".join(
        f'<div class="card stat" id="total-{key}"><div class="k">{name}</div><div class="v">{value}</div>'
        f'<div class="s">{sub}</div></div>'
        for key, name, value, sub in cards
    ) + "</section>"


def _lineage_note(t: dict[str, Any]) -> str:
    lin = t.get("lineage") or {}
    if lin.get("split"):
        return '<span class="bad">split: groups no longer meet</span>'
    if lin.get("compared_step") is None:
        return "no outer step to compare yet"
    return f'at outer step {int(lin["compared_step"])} · {int(lin["peers_compared"])} peers'


def _lineage_warning(doc: dict[str, Any]) -> str:
    warning = ((doc.get("totals") or {}).get("lineage") or {}).get("warning")
    return f'<p class="warning" id="split-warning">warning: {text(warning, 400)}</p>' if warning else ""


def _round(row: dict[str, Any]) -> str:
    ok, size = row.get("last_round_ok"), row.get("last_round_group_size") or 0
    if ok is None:
        main = "–"
    elif size <= 1:  # no group formed: not a failure
        main = "solo"
    elif not ok:
        main = '<span class="bad">failed</span>'
    else:
        main = f"{int(size)} peers"
    if ok is not None:
        main += f' <span class="dim">{fmt_float(row.get("last_round_s"), 1)} s</span>'
    failed = row.get("failed_rounds") or 0
    if failed:
        main += f' <span class="bad">({int(failed)} failed)</span>'
    return main


def _peer_table(doc: dict[str, Any], colors: dict[str, int]) -> str:
    heads = ["State", "Peer", "Device", "Outer step", "Loss", "Tokens/s", "Last round", "Goodput", "Reach",
             "Uptime", "Traffic"]
    avoided = {e["peer_id"]: e for e in (doc.get("totals") or {}).get("avoided") or []}
    body = []
    for r in doc["peers"]:
        state = r["state"]
        name = text(r.get("name"), 64)
        pid = text(r.get("peer_id"), 128)
        swatch = f'<span class="swatch c{colors[r["owner"]]}"></span>' if r["owner"] in colors else ""
        peer = (swatch
                + (f'<b class="name">{name}</b><br>' if name else "")
                + f'<code class="pid" title="{pid}">{text(short_id(r.get("peer_id")))}</code>')
        if r.get("peer_id") in avoided and r["state"] != "gone":
            e = avoided[r["peer_id"]]
            peer += (f'<br><span class="bad avoided" title="{text(avoided_text(e), 600)}">'
                     f'avoided by {len(e["by"])} of {int(e["of"])}</span>')
        reach = {"public": "public", "unverified": "public?", "client": "client"}.get(r.get("reachability"), "–")
        version = text(r.get("version"), 32)
        heard = "said goodbye" if r.get("left") else f'heard {fmt_duration(r.get("age_s"))} ago'
        paused = ""  # in the swarm, training no more for now (node/pause.py)
        if r.get("paused") and state != "gone":
            why = "outside its active hours" if r["paused"] == "active_hours" else "by its owner"
            paused = f'<br><span class="badge paused" title="{why}">paused</span>'
        cells = [
            f'<span class="badge {state}">{state}</span>{paused}',
            peer,
            f'{text(r.get("device"), 64)} <span class="dim">{text(r.get("precision"), 16)}</span>'
            + (f'<br><span class="dim">v{version}</span>' if version else ""),
            text(r.get("outer_step")),
            f'{fmt_float(r.get("loss"))}<br><span class="dim">{fmt_held_out(r.get("eval_loss"), r.get("eval_outer_step"))}</span>',
            fmt_si(r.get("tokens_per_s")),
            _round(r),
            "–" if r.get("goodput") is None else f'{100 * r["goodput"]:.0f}%',
            reach,
            f'{fmt_duration(r.get("uptime_s"))}<br><span class="dim">{heard}</span>',
            f'↑{fmt_bytes(r.get("bytes_sent"))}<br>↓{fmt_bytes(r.get("bytes_received"))}',
        ]
        tds = "".join(f'<td class="col-{i}" data-label="{h}"><span class="cv">{c}</span></td>'
                      for i, (h, c) in enumerate(zip(heads, cells)))
        body.append(f'<tr class="peer {state}" data-owner="{text(r["owner"])}" data-peer-id="{pid}">{tds}</tr>')
    if not body:
        body.append(f'<tr class="none"><td colspan="{len(heads)}">No peer has published a record yet. '
                    "Peers appear here a few seconds after they join.</td></tr>")
    th = "".join(f"<th>{h}</th>" for h in heads)
    return (f'<section class="card peers"><h2>Peers</h2><div class="scroll"><table id="peers"><thead><tr>{th}</tr>'
            f'</thead><tbody>{"".join(body)}</tbody></table></div>{_states_legend(doc)}</section>')


def _avoided(doc: dict[str, Any]) -> str:
    """The peers that online peers keep out of their groups, and who says so (empty when none)."""
    entries = (doc.get("totals") or {}).get("avoided") or []
    if not entries:
        return ""
    items = "".join(
        f'<li data-peer-id="{text(e["peer_id"], 128)}">'
        + (f'<b class="name">{text(e.get("name"), 64)}</b> ' if e.get("name") else "")
        + f'<code class="pid" title="{text(e["peer_id"], 128)}">{text(short_id(e["peer_id"]))}</code> '
        + f'{text(avoided_text(e), 600)}</li>'
        for e in entries)
    return ('<section class="card avoided-list" id="avoided"><h2>Avoided peers</h2>'
            '<p class="dim">what online peers say about others: each keeps these out of its averaging groups '
            f'(a peer\'s own word, not proof)</p><ul>{items}</ul></section>')


def _states_legend(doc: dict[str, Any]) -> str:
    c = doc["config"]
    return (
        '<ul class="states">'
        f'<li><span class="badge online">online</span> record refreshed in the last {fmt_duration(c["stale_after_s"])}</li>'
        f'<li><span class="badge stale">stale</span> silent for {fmt_duration(c["stale_after_s"])}–'
        f'{fmt_duration(c["gone_after_s"])}: busy, stuck or crashed</li>'
        f'<li><span class="badge gone">gone</span> left, or silent for longer; listed for '
        f'{fmt_duration(c["keep_gone_s"])}</li>'
        '<li><span class="badge paused">paused</span> in the swarm, training no more for now (by its owner, or '
        'outside its active hours): no round waits for it</li></ul>'
    )


def _peer_link(peer_id: Any, label: str, base: str = "") -> str:
    """A link to a volunteer's page (``{base}peer/{peer_id}``: relative, so the page works under a path prefix)."""
    return f'<a href="{base}peer/{text(quote(str(peer_id or ""), safe=""), 200)}">{label}</a>'


def _ledger_note(e: dict[str, Any]) -> str:
    if e.get("self_reported"):
        return f'<span class="badge self" title="{text(e.get("why"), 400)}">self-reported</span>'
    n = int(e.get("witnesses") or 0)
    return f'<span class="dim">backed by {n} peer{"s" if n != 1 else ""}</span>' if n else '<span class="dim">–</span>'


def _leaderboard(doc: dict[str, Any]) -> str:
    """The contributors, most confirmed tokens first (dht/ledger.py); each name links to its page."""
    heads = ["#", "Contributor", "Tokens", "Share", "Verified rounds", "Uptime", "Evidence"]
    body = []
    for i, e in enumerate(doc.get("leaderboard") or [], 1):
        share, confirmed = e.get("share"), e.get("confirmed_share")
        cells = [str(i), _peer_link(e.get("peer_id"), f'<b class="name">{text(e.get("name"), 64)}</b>'),
                 f'{fmt_si(e.get("tokens"))}<br><span class="dim">{fmt_si(e.get("confirmed_tokens"))} confirmed</span>',
                 ("–" if share is None else f"{100 * share:.1f}%")
                 + f'<br><span class="dim">{"–" if confirmed is None else f"{100 * confirmed:.1f}%"} of confirmed</span>',
                 f'{int(e.get("verified_rounds") or 0)}<br><span class="dim">{int(e.get("confirmed_rounds") or 0)} confirmed</span>',
                 fmt_duration(e.get("uptime_s")), _ledger_note(e)]
        body.append('<tr class="lb">' + "".join(f'<td data-label="{h}">{c}</td>' for h, c in zip(heads, cells)) + "</tr>")
    if not body:
        return ""
    th = "".join(f"<th>{h}</th>" for h in heads)
    return (f'<section class="card leaderboard"><h2>Contributors</h2><div class="scroll"><table id="leaderboard" class="plain">'
            f'<thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
            '<p class="dim note">Each peer reports its own tokens and rounds; <em>confirmed</em> is the most that another '
            "peer's record says it shared in verified rounds (a lower bound: groups smaller than the swarm confirm "
            "less). <em>self-reported</em>: claims beyond what others back.</p></section>")


def render_live(doc: dict[str, Any], now: float | None = None) -> str:
    """The part of the page that refreshes: status bar, totals, charts, peer table."""
    now = doc.get("generated", time.time()) if now is None else now
    colors = _charted(doc)
    if doc.get("last_poll") is None:
        status = '<span class="dot wait"></span>connecting to the swarm…'
    elif doc.get("last_poll_ok"):
        status = f'<span class="dot ok"></span>live · DHT read {fmt_duration(now - doc["last_poll"])} ago'
    else:
        status = '<span class="dot bad"></span>cannot read the DHT right now; showing the last known state'
    return (f'<p class="status" id="status">{status}</p>' + _lineage_warning(doc) + _totals(doc) + _charts(doc, colors, now)
            + _peer_table(doc, colors) + _avoided(doc) + _leaderboard(doc))


CSS = """
:root{--bg:#f6f7f9;--fg:#1d2330;--card:#fff;--line:#e3e6eb;--dim:#6b7280;--plot:#fbfcfd;--ok:#1a7f37;--warn:#9a6700;
--bad:#cf222e;--total:#1d2330;color-scheme:light dark}
@media (prefers-color-scheme:dark){:root{--bg:#0f1216;--fg:#e6e8eb;--card:#181c22;--line:#2a3038;--dim:#9aa3ad;
--plot:#14181d;--ok:#3fb950;--warn:#d29922;--bad:#f85149;--total:#e6e8eb}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
header,main,footer{max-width:1280px;margin:0 auto;padding:0 16px}
header{display:flex;flex-wrap:wrap;align-items:baseline;gap:4px 14px;padding-top:18px}
h1{font-size:1.35rem;margin:0}h2{font-size:1.05rem;margin:0 0 8px}
.run{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;background:var(--card);border:1px solid var(--line);
border-radius:6px;padding:1px 8px;overflow-wrap:anywhere}
.status{margin:6px 0 12px;color:var(--dim);font-size:.9rem}
.dot{display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:6px;background:var(--dim)}
.dot.ok{background:var(--ok)}.dot.bad{background:var(--bad)}
body.offline .status::after{content:" · page not refreshing (dashboard unreachable)";color:var(--bad)}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px;margin:0}
.totals{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:10px;margin-bottom:12px}
.stat .k{color:var(--dim);font-size:.8rem;text-transform:uppercase;letter-spacing:.04em}
.stat .v{font-size:1.7rem;font-weight:650;font-variant-numeric:tabular-nums}
.stat .s{color:var(--dim);font-size:.82rem}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,420px),1fr));gap:10px;margin-bottom:12px}
figcaption{font-weight:600;margin-bottom:4px}
svg.chart{width:100%;height:auto;display:block;font-size:12px}
svg.chart .plot{fill:var(--plot);stroke:var(--line)}
svg.chart .grid{stroke:var(--line);stroke-width:1}
svg.chart .tick,svg.chart .empty{fill:var(--dim)}
svg.chart .series path{fill:none;stroke:var(--c);stroke-width:1.6;stroke-linejoin:round;stroke-linecap:round;opacity:.9}
svg.chart .series circle{fill:var(--c)}
svg.chart .series.main path{stroke-width:2.6;opacity:1}
.legend{list-style:none;display:flex;flex-wrap:wrap;gap:2px 14px;padding:0;margin:6px 0 0;font-size:.82rem;color:var(--dim)}
.swatch{display:inline-block;width:10px;height:10px;border-radius:3px;margin-right:5px;background:var(--c);vertical-align:-1px}
.total{--c:var(--total)}
.c0{--c:#4e79a7}.c1{--c:#f28e2b}.c2{--c:#e15759}.c3{--c:#76b7b2}.c4{--c:#59a14f}
.c5{--c:#edc948}.c6{--c:#b07aa1}.c7{--c:#ff9da7}.c8{--c:#9c755f}.c9{--c:#8c8c8c}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:.88rem;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:6px 8px;border-bottom:1px solid var(--line);white-space:nowrap}
th{color:var(--dim);font-weight:600;font-size:.78rem;text-transform:uppercase;letter-spacing:.03em}
td .name{font-weight:600;overflow-wrap:anywhere;white-space:normal}
td.col-1{max-width:16em;white-space:normal}
code.pid{font-size:.8rem;color:var(--dim);white-space:nowrap}
tr.stale td{opacity:.55}tr.gone td{opacity:.38}tr.gone .name{text-decoration:line-through}
.badge{display:inline-block;border-radius:99px;padding:0 8px;font-size:.75rem;font-weight:600;border:1px solid}
.warning{color:var(--bad);font-weight:600;margin:4px 0 10px}
.badge.online{color:var(--ok)}.badge.stale{color:var(--warn)}.badge.gone{color:var(--dim)}.badge.paused{color:var(--warn)}
.dim{color:var(--dim)}.bad{color:var(--bad)}
.leaderboard,.avoided-list{margin-top:12px}.badge.self{color:var(--warn)}.note{font-size:.82rem;margin:8px 0 0}
.avoided-list{margin-top:12px}.avoided-list ul{margin:0;padding-left:18px;font-size:.88rem}
.states{list-style:none;padding:0;margin:10px 0 0;display:flex;flex-wrap:wrap;gap:4px 18px;color:var(--dim);font-size:.82rem}
footer{color:var(--dim);font-size:.82rem;padding:16px}footer a{color:inherit}
@media (max-width:720px){
body{font-size:14px}header,main,footer{padding:0 10px}
.stat .v{font-size:1.35rem}svg.chart{font-size:17px}
table,tbody{display:block;width:100%}thead{display:none}
tr.peer{display:grid;grid-template-columns:1fr 1fr;gap:6px 12px;border:1px solid var(--line);border-radius:8px;
margin:0 0 8px;padding:8px 10px}
tr.peer td{display:block;border:0;padding:0;white-space:normal;min-width:0}
tr.peer td::before{content:attr(data-label);display:block;color:var(--dim);font-size:.7rem;text-transform:uppercase;
letter-spacing:.03em}
tr.peer td.col-0{grid-column:2;grid-row:1;text-align:right}tr.peer td.col-0::before{content:none}
tr.peer td.col-1{grid-column:1;grid-row:1}tr.peer td.col-1::before{content:none}
tr.none,tr.none td{display:block}
table.plain{display:table}table.plain thead{display:table-header-group}table.plain tbody{display:table-row-group}
}
"""

JS_TEMPLATE = """(function(){var el=document.getElementById('live'),busy=false;
setInterval(function(){if(busy||document.hidden)return;busy=true;
fetch('fragment',{cache:'no-store'}).then(function(r){if(!r.ok)throw new Error(r.status);return r.text();})
.then(function(t){el.innerHTML=t;document.body.classList.remove('offline');})
.catch(function(){document.body.classList.add('offline');})
.finally(function(){busy=false;});},REFRESH_MS);})();"""


def _sha256(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


def page_script(refresh_s: float) -> str:
    return JS_TEMPLATE.replace("REFRESH_MS", str(max(500, int(refresh_s * 1000))))


def content_security_policy(refresh_s: float) -> str:
    """Only this module's inline script and style may run; fetches go to this origin only."""
    return (f"default-src 'none'; script-src {_sha256(page_script(refresh_s))}; style-src {_sha256(CSS)}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def render_page(doc: dict[str, Any], *, refresh_s: float = 5.0, version: str = "") -> str:
    run = text(doc["run_id"], 128)
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{run} · diloco-swarm</title>"
        '<meta name="referrer" content="no-referrer">'
        f'<noscript><meta http-equiv="refresh" content="{max(5, int(refresh_s * 2))}"></noscript>'
        f"<style>{CSS}</style></head><body>"
        f'<header><h1>diloco-swarm</h1><span class="run" id="run-id" title="run id">{run}</span></header>'
        f'<main id="live">{render_live(doc)}</main>'
        f'<footer>Peers publish signed records in the DHT; this page reads them every few seconds. '
        f'<a href="api/v1/state">JSON API</a> · <a href="metrics">Prometheus metrics</a>'
        f'{" · dashboard " + text(version, 32) if version else ""}</footer>'
        f"<script>{page_script(refresh_s)}</script></body></html>"
    )


def _head(title: str) -> str:
    return ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<title>{title} · diloco-swarm</title><meta name="referrer" content="no-referrer">'
            f"<style>{CSS}</style></head><body>")


def render_peer_page(doc: dict[str, Any] | None, *, peer_id: str, run_id: str, version: str = "") -> str:
    """One volunteer's page (``/peer/{peer_id}``): its figures, ledger row, witnesses and θ marks, from
    ``SwarmState.peer_doc`` (None: no record names the peer, a "not found" page). No script: it is read
    once, not refreshed."""
    run = text(run_id, 128)
    back = '<a href="../">all peers</a>'
    if doc is None:
        return (_head(f"unknown peer · {run}") + f'<header><h1>diloco-swarm</h1><span class="run">{run}</span></header>'
                f'<main><p class="warning">No record of peer <code>{text(peer_id, 128)}</code> in this run '
                f"(it never joined, or left more than a while ago).</p><p>{back}</p></main></body></html>")
    r, e = doc["peer"], doc["ledger"] or {}
    name = text(r.get("name"), 64) or text(short_id(r.get("peer_id")))
    now = doc.get("generated", time.time())
    hist = doc.get("history") or {}
    loss = line_chart([{"label": "loss", "color": 0, "main": True,
                        "points": list(zip(hist.get("t", []), hist.get("loss", [])))}],
                      title="Training loss over time", now=now, unit_fmt=lambda v: f"{v:.3g}")
    facts = [
        ("State", f'<span class="badge {text(r.get("state"))}">{text(r.get("state"))}</span>'),
        ("Outer step", text(r.get("outer_step"))),
        ("Loss", f'{fmt_float(r.get("loss"))} <span class="dim">{fmt_held_out(r.get("eval_loss"), r.get("eval_outer_step"))}</span>'),
        ("Tokens", f'{fmt_si(e.get("tokens"))} <span class="dim">({fmt_si(e.get("verified_tokens"))} in verified rounds, '
                   f'{fmt_si(e.get("confirmed_tokens"))} confirmed)</span>'),
        ("Share of the run's tokens", "–" if e.get("share") is None else f'{100 * e["share"]:.1f}%'),
        ("Verified rounds", f'{int(e.get("verified_rounds") or 0)} <span class="dim">'
                            f'({int(e.get("confirmed_rounds") or 0)} confirmed)</span> {_ledger_note(e)}'),
        ("Failed rounds", text(r.get("failed_rounds"))),
        ("Traffic", f'↑{fmt_bytes(r.get("bytes_sent"))} ↓{fmt_bytes(r.get("bytes_received"))}'),
        ("Uptime", fmt_duration(r.get("uptime_s"))),
        ("Device", f'{text(r.get("device"), 64)} <span class="dim">{text(r.get("precision"), 16)}</span>'),
    ]
    rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    witnesses = "".join(f'<li>{_peer_link(w["peer_id"], text(w.get("name") or short_id(w["peer_id"]), 64), "../")}: '
                        f'{int(w["rounds"])} verified rounds, {fmt_si(w["tokens"])} tokens</li>'
                        for w in doc.get("witnessed_by") or [])
    marks = "".join(f'<tr><td>{int(m["step"])}</td><td><code>{text(m["digest"], 16)}</code></td>'
                    f'<td>{len(m.get("held_by") or [])}</td></tr>' for m in doc.get("theta_marks") or [])
    why = f'<p class="warning">self-reported: {text(e.get("why"), 400)}</p>' if e.get("self_reported") else ""
    return (
        _head(f"{name} · {run}")
        + f'<header><h1>{name}</h1><span class="run" title="peer id">{text(r.get("peer_id"), 128)}</span>'
        f'<span class="dim">run {run} · {back}</span></header><main>{why}'
        f'<section class="card"><table id="peer-facts" class="plain">{rows}</table>'
        '<p class="dim note">Every figure here is this peer\'s own word (its signed record), except the '
        "<em>confirmed</em> ones: the most that another peer's record says it shared with it in verified rounds.</p>"
        "</section>"
        f'<section class="charts leaderboard"><figure class="card"><figcaption>Loss</figcaption>{loss}</figure></section>'
        f'<section class="card leaderboard"><h2>Backed by</h2>'
        + (f'<ul id="witnesses">{witnesses}</ul>' if witnesses else '<p class="dim">No other record lists this peer.</p>')
        + '</section><section class="card leaderboard"><h2>Outer steps its Δ went into</h2>'
        + ('<table id="theta-marks" class="plain"><thead><tr><th>Outer step</th><th>θ digest</th>'
           f"<th>Peers holding the same θ</th></tr></thead><tbody>{marks}</tbody></table>"
           '<p class="dim note">Its last θ marks (outer step, digest of the θ_global it held after it): a digest '
           "other peers hold too is a step of the swarm's shared lineage.</p>"
           if marks else '<p class="dim">Its record holds no θ marks yet.</p>')
        + f'</section></main><footer><a href="../api/v1/peer/{text(quote(str(r.get("peer_id") or ""), safe=""), 200)}">JSON</a>'
        f'{" · dashboard " + text(version, 32) if version else ""}</footer></body></html>'
    )
