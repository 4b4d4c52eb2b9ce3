"""``diloco-node status``: one look at a swarm from the terminal (or as JSON)."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import time
from typing import Annotated, Any, Callable

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from diloco_swarm.cli.common import fail, node_missing, require_finite
from diloco_swarm.cli.text import DEFAULT_RUN_ID, printable

# Every command, --help included, imports this module (cli/app.py). "lazy": the rest loads when a
# reader runs: hivemind (~2 s) or the light client (~0.15 s; libp2p ~0.6 s more), pydantic (~0.1 s).

STALE_AFTER_S = 20.0
PIPED_WIDTH = 160  # columns of the table when stdout is not a terminal (rich would fold it to 80)
REDIAL_EVERY_S = 10.0  # a reader that finds no record re-dials its --initial-peers at most this often
NO_PEERS = 1  # exit code of a look that found no peer record of the run (2: bad input or an unreadable swarm)


def dht_listen_host(initial_peers: list[str]) -> str:
    """127.0.0.1 when every initial peer is on this machine, else all interfaces (so we can dial out)."""
    for addr in initial_peers:
        parts = addr.split("/")
        host = parts[2] if len(parts) > 2 else ""
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return "0.0.0.0"
        except ValueError:  # /dns4/..., /dns/...
            return "0.0.0.0"
    return "127.0.0.1"


def join_as_reader(initial_peers: list[str], run_id: str):
    """A client-mode DHT with the run's record validators (an ephemeral record key).

    :raises SwarmError: bad address, or no initial peer answered.
    """
    # lazy: hivemind
    from diloco_swarm.dht.signing import record_validators
    from diloco_swarm.dht.swarm import start_dht

    return start_dht(initial_peers=initial_peers, host=dht_listen_host(initial_peers), port=0, client_mode=True,
                     record_validators=record_validators(run_id, None))


def reader_message(e: Exception) -> str:
    """A SwarmError's text, minus advice that only fits ``join``."""
    return (str(e).replace(", or omit --initial-peers to start a new swarm", "")
            .replace(" (0 = any free port)", ""))


LIGHT_HELP = ("Read the swarm with the py-libp2p light client (no hivemind, no Go daemon). The default when "
              "hivemind or torch is not installed.")


def use_light(light: bool) -> bool:
    """The light client when asked, or when this install lacks the training node (the [node] extra)."""
    return light or node_missing() is not None


def parse_peers(initial_peers: list[str], light: bool) -> list[str]:
    """Checked ``--initial-peers`` multiaddrs (several per value, separated by spaces or commas).

    :raises ValueError: a bad multiaddr, or none given (its text is the one-line error).
    """
    if light:
        from diloco_swarm.light.client import LightError, parse_peer_maddr  # lazy

        peers = [item for value in initial_peers for item in value.replace(",", " ").split()]
        for item in peers:
            try:
                parse_peer_maddr(item)
            except LightError as e:  # not a peer multiaddr, no TCP address, or a name that does not resolve
                raise ValueError(f"--initial-peers: {e}") from None
    else:
        from diloco_swarm.dht.swarm import SwarmError, parse_initial_peers  # lazy: hivemind

        try:
            peers = parse_initial_peers(initial_peers)
        except SwarmError as e:
            raise ValueError(str(e)) from None
    if not peers:
        raise ValueError("--initial-peers: give the multiaddr of at least one node of the swarm")
    return peers


EntriesReader = Callable[[], "list | None"]  # () -> [PeerEntry], or None when the DHT could not be read


def open_reader(peers: list[str], run_id: str, light: bool) -> tuple[EntriesReader, Callable[[], None]]:
    """``(read, close)``: one look at the run's verified records per ``read()``.

    hivemind: a client-mode DHT (a daemon process) kept open until ``close()``. A read that finds no
    record re-dials ``peers`` (at most every ``REDIAL_EVERY_S`` s: the peers it knew may have restarted
    at the same address) and returns None, a failed read, when none of them answers. Light: each read
    dials afresh (a few ms on a LAN) and never raises; nothing to close.

    :raises ValueError: no initial peer answered, or the DHT could not start (its text is the one-line error).
    """
    if light:
        # lazy
        from diloco_swarm.light.client import LightError
        from diloco_swarm.light.reader import entries_reader, read_swarm

        try:  # the first look raises, so that an unreachable swarm is one clear error
            first = [read_swarm(peers, run_id).entries]
        except LightError as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # libp2p internals: still one line
            raise ValueError(f"the light client could not read the swarm: {e!r}"[:300]) from None
        later = entries_reader(peers, run_id)
        return (lambda: first.pop() if first else later()), (lambda: None)
    # lazy: hivemind
    from diloco_swarm.dht.records import read_peer_entries
    from diloco_swarm.dht.swarm import SwarmError, published_organiser
    from diloco_swarm.node.redial import dial_peers

    try:
        dht = join_as_reader(peers, run_id)
    except SwarmError as e:
        raise ValueError(reader_message(e)) from None
    last_dial = time.monotonic()

    def read():
        nonlocal last_dial
        organiser = published_organiser(dht, run_id)  # a private run: records without a valid invitation refused
        entries = read_peer_entries(dht, run_id, organiser=organiser)
        if any(e.record is not None for e in entries or ()) or time.monotonic() - last_dial < REDIAL_EVERY_S:
            return entries  # (tombstones alone do not count: a swarm of departed peers may have restarted)
        last_dial = time.monotonic()
        if not dial_peers(dht, peers):
            return None  # cut off from the swarm: a failed poll, not an empty swarm
        return read_peer_entries(dht, run_id, organiser=organiser)

    return read, dht.shutdown


def collect_rows(read: EntriesReader, *, attempts: int = 3,
                 stale_after_s: float = STALE_AFTER_S) -> tuple[list[dict[str, Any]], list[str]] | None:
    """Peer rows (record fields + owner, state, age_s) for one look, and why each record a private run
    refused was refused (``PeerEntry.refused``); None when the DHT could not be read.

    One look has no history, so the state comes from the record's own ``updated`` time:
    online when at most ``stale_after_s`` old (by our clock), else stale.
    """
    from diloco_swarm.dht.records import FIELDS  # lazy: pydantic

    entries = None
    for i in range(attempts):
        entries = read()
        if entries:
            break
        if i + 1 < attempts:
            time.sleep(1.0)  # a fresh client may need a moment to fill its routing table
    if entries is None:
        return None
    now = time.time()
    rows = []
    for e in entries:
        if e.record is None:
            continue
        r = e.record.dict()
        age = max(0.0, now - r["updated"])
        rows.append({**{k: r[k] for k in FIELDS}, "owner": e.owner, "age_s": round(age, 1),
                     "state": "online" if age <= stale_after_s else "stale"})
    rows.sort(key=lambda r: (r["state"] != "online", -r["outer_step"], r["name"], r["peer_id"]))
    return rows, [e.refused for e in entries if e.refused]


def _f(value: Any, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render_table(rows: list[dict[str, Any]], run_id: str, width: int = 120) -> Table:
    """The peer table; below 110 columns it leaves out device, goodput and uptime to stay readable
    (reach stays: it says who can average with whom)."""
    from diloco_swarm.dashboard.charts import fmt_duration, fmt_si, short_id  # lazy: pydantic

    wide = width >= 110
    table = Table(title=Text(f"run {run_id}"), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 1))
    table.add_column("peer", min_width=14, overflow="fold")
    table.add_column("state", no_wrap=True)
    if wide:
        table.add_column("device", min_width=6, overflow="fold")
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column("tok/s", justify="right", no_wrap=True)
    table.add_column("last round", no_wrap=True)
    if wide:
        table.add_column("goodput", justify="right", no_wrap=True)
    table.add_column("reach", no_wrap=True)
    if wide:
        table.add_column("uptime", justify="right", no_wrap=True)
    for r in rows:
        # Every string here comes from another peer: printable() drops terminal control characters,
        # and Text (never a plain str) keeps rich from reading [brackets] as markup.
        peer = Text(printable(r["name"]) + " " if r["name"] else "", style="bold")
        peer.append(short_id(printable(r["peer_id"])), style="dim")
        last_failed = r["last_round_ok"] is False and r["last_round_group_size"] >= 2  # a solo round is not a failure
        if r["last_round_ok"] is None:
            rnd = Text("–")
        elif last_failed:
            rnd = Text("failed", style="red")
        else:
            rnd = Text("solo" if r["last_round_group_size"] <= 1 else f"{r['last_round_group_size']} peers ok")
        if r["failed_rounds"]:
            rnd.append(f" ({r['failed_rounds']} in all)" if last_failed else f" ({r['failed_rounds']} failed)", style="red")
        state = Text(r["state"], style="green" if r["state"] == "online" else "yellow")
        if r.get("paused") and r["state"] != "gone":  # in the swarm, training no more for now (node/pause.py)
            state = Text(f"{r['state']}, paused" + (" (hours)" if r["paused"] == "active_hours" else ""), style="yellow")
        reach = Text(printable(r["reachability"]))
        if wide:
            cells = [peer, state, Text(printable(f"{r['device']} {r['precision']}").strip()), str(r["outer_step"]),
                     _f(r["loss"]), fmt_si(r["tokens_per_s"]), rnd, f"{100 * r['goodput']:.0f}%", reach,
                     fmt_duration(r["uptime_s"])]
        else:
            cells = [peer, state, str(r["outer_step"]), _f(r["loss"]), fmt_si(r["tokens_per_s"]), rnd, reach]
        table.add_row(*cells, style="dim" if r["state"] != "online" else None)
    return table


def render_leaderboard(board: list[dict[str, Any]]) -> Table:
    """The contributors (dht/ledger.py ``leaderboard``): tokens and verified rounds as claimed, with what
    other peers' records confirm; ``self-reported`` where the claims run ahead of them."""
    from diloco_swarm.dashboard.charts import fmt_duration, fmt_si  # lazy: pydantic

    table = Table(title=Text("contributors online (most confirmed tokens first)"), title_justify="left",
                  header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    table.add_column("contributor", min_width=10, overflow="fold")
    for head in ("tokens", "confirmed", "confirmed share", "rounds", "confirmed"):
        table.add_column(head, justify="right", no_wrap=True)
    table.add_column("uptime", justify="right", no_wrap=True)
    table.add_column("evidence", no_wrap=True)
    for e in board:
        share = "–" if e["confirmed_share"] is None else f"{100 * e['confirmed_share']:.1f}%"
        evidence = (Text("self-reported", style="yellow") if e["self_reported"]
                    else Text(f"{e['witnesses']} peer{'s' if e['witnesses'] != 1 else ''}" if e["witnesses"] else "–"))
        table.add_row(Text(printable(e["name"])), fmt_si(e["tokens"]), fmt_si(e["confirmed_tokens"]), share,
                      str(e["verified_rounds"]), str(e["confirmed_rounds"]), fmt_duration(e["uptime_s"]), evidence)
    return table


def summary_line(totals: dict[str, Any]) -> str:
    from diloco_swarm.dashboard.charts import fmt_held_out, fmt_si  # lazy: pydantic

    parts = [f"{totals['peers_online']} peer{'s' if totals['peers_online'] != 1 else ''} online"]
    if totals["peers_stale"]:
        parts[0] += f" ({totals['peers_stale']} stale)"
    parts.append(f"{fmt_si(totals['tokens_per_s'])} tok/s")
    step = totals["newest_outer_step"]
    parts.append(f"newest outer step {'–' if step is None else step}")
    parts.append(f"mean loss {_f(totals['mean_loss'])}")
    if totals.get("mean_eval_loss") is not None:
        parts.append(fmt_held_out(totals["mean_eval_loss"], totals.get("eval_outer_steps")))
    lineages = totals["lineages"]
    if lineages is not None:
        parts.append(f"{lineages} θ lineage{'s' if lineages != 1 else ''}")
    return " · ".join(parts)


def status(
    initial_peers: Annotated[list[str], typer.Option("--initial-peers", help="Multiaddr of any node of the swarm (/ip4/HOST/tcp/PORT/p2p/PEER_ID), as printed by that node. Repeat or separate with spaces.")],
    run_id: Annotated[str, typer.Option(help="The run to show.")] = DEFAULT_RUN_ID,
    json_output: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of the table.")] = False,
    stale_after: Annotated[float, typer.Option(min=1.0, help="A peer whose record is older than this many seconds is shown as stale.")] = STALE_AFTER_S,
    light: Annotated[bool, typer.Option("--light", help=LIGHT_HELP)] = False,
) -> None:
    """Show the peers of a swarm: one row per peer, and a summary line.

    Joins the DHT as a client (it never trains and accepts no connections), reads every peer's signed record, prints, and leaves. Exit code 0 when it found a peer of the run, 1 when it found none (--json too), 2 on bad input or when no initial peer answered.
    """
    # lazy: pydantic
    from diloco_swarm.spec import run_id_problem
    from diloco_swarm.dashboard.state import summarize
    from diloco_swarm.dht.ledger import leaderboard

    require_finite(stale_after=stale_after)
    # piped (a log, a script): rows of one line each, not folded to rich's 80-column default ($COLUMNS wins)
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    out = Console(highlight=False, width=PIPED_WIDTH) if piped else Console(highlight=False)
    if run_id_problem(run_id):
        raise fail(run_id_problem(run_id))
    light = use_light(light)
    try:
        peers = parse_peers(initial_peers, light)
        read, close = open_reader(peers, run_id, light)
    except ValueError as e:
        raise fail(str(e))
    try:
        looked = collect_rows(read, stale_after_s=stale_after)
    finally:
        close()
    if looked is None:
        raise fail("could not read the swarm's records from the DHT; check --initial-peers and try again")
    rows, refused = looked
    totals = {**summarize(rows), "refused": len(refused)}
    board = leaderboard(rows)
    if json_output:
        doc = {"run_id": run_id, "time": round(time.time(), 3), "summary": totals, "peers": rows, "leaderboard": board}
        print(json.dumps(doc, indent=2, allow_nan=False))
        if not rows:
            raise typer.Exit(NO_PEERS)  # a script tells an empty run from a live one by the code alone
        return
    if not rows:
        hint = " (the default; give the --run-id your nodes print)" if run_id == DEFAULT_RUN_ID else ""
        out.print(Text(f"no peer records found for run '{run_id}'{hint}: is the run id right, and are its nodes running?"),
                  soft_wrap=True)
        raise typer.Exit(NO_PEERS)
    out.print(render_table(rows, run_id, width=out.width))
    out.print(Text(summary_line(totals)), soft_wrap=True)
    out.print(render_leaderboard(board))
    if totals["lineage"]["warning"]:
        out.print(Text("warning: " + totals["lineage"]["warning"], style="yellow"), soft_wrap=True)
    for line in avoided_lines(totals):
        out.print(Text(line, style="yellow"), soft_wrap=True)
    if refused:
        out.print(Text(printable(f"refused {len(refused)} record{'s' if len(refused) != 1 else ''} of peers without a "
                                 f"valid invitation to this private run ({refused[0]}{', …' if len(refused) > 1 else ''})"),
                       style="yellow"), soft_wrap=True)


def avoided_lines(totals: dict[str, Any]) -> list[str]:
    """One line per peer that online peers keep out of their groups (``summarize``'s ``avoided``),
    control characters dropped: ``peer x0 3f9a2c…e0b1d4 avoided by 2 of 4 peers (h0, h1): its Δ was ...``."""
    from diloco_swarm.dashboard.render import avoided_text, short_id  # lazy: pydantic

    return [printable(f"peer {e['name'] + ' ' if e.get('name') else ''}{short_id(e['peer_id'])} {avoided_text(e)}")
            for e in totals.get("avoided") or []]
