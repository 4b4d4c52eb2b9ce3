"""Strings from other peers (and from error messages that quote them) cannot drive the terminal."""

import io

from rich.console import Console

from diloco_swarm.cli.common import fail
from diloco_swarm.cli.status import render_table
from diloco_swarm.cli.text import printable

HOSTILE = "eve\x1b]0;pwned\x07\x1b[2J\r\nfake row\u202e[bold red]x[/] [link=http://x]y[/link]"


def row(**over):
    base = {"peer_id": "QmcaAm1dbxe3yDbWTLWVedDN8xTYf3NXS6TCfAyaMH5dcK", "name": "alice", "version": "0.1.0",
            "device": "cpu", "precision": "fp32", "reachability": "public", "outer_step": 3, "tokens_per_s": 1200.0,
            "loss": 2.5, "eval_loss": 2.6, "last_round_group_size": 2, "last_round_ok": True, "failed_rounds": 0,
            "goodput": 0.9, "uptime_s": 100.0, "state": "online", "age_s": 1.0}
    return {**base, **over}


def test_printable_drops_control_characters_and_flattens_whitespace():
    assert printable(HOSTILE) == "eve]0;pwned[2J  fake row[bold red]x[/] [link=http://x]y[/link]"
    assert printable("plain name [1]") == "plain name [1]"
    assert printable("zero\u200bwidth\ttab") == "zerowidth tab"


def test_status_table_shows_peer_strings_as_inert_text():
    rows = [row(name=HOSTILE, device="cuda\x1b[31m", precision="bf16\n[blink]"), row(name="[b]bob[/b]")]
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(render_table(rows, "my-run", 200))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\r" not in text
    assert "fake row" in text and "[bold red]x[/]" in text  # brackets shown, not read as markup
    assert "[b]bob[/b]" in text and "[blink]" in text
    assert len([line for line in text.splitlines() if line.strip()]) == 5  # title, header, rule, 2 rows: no injected line


def test_error_lines_drop_control_characters(capsys):
    code = fail(f"peer said {HOSTILE}")
    err = capsys.readouterr().err
    assert err.startswith("error: peer said eve") and err.endswith("y[/link]\n")
    assert err.count("\n") == 1 and "\x1b" not in err and "\u202e" not in err
    assert "[bold red]x[/]" in err
    assert code.exit_code == 2


def test_status_table_at_80_columns_keeps_reach():
    rows = [row(name="alice", reachability="client", failed_rounds=2, last_round_ok=False),
            row(name="bob", reachability="unverified", peer_id="QmXrYYRZm9dFWsiVF8eeJst9kbbLM8ZwKnKbb1dS2U4Hkr")]
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=False, color_system=None).print(render_table(rows, "my-run", 80))
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert "reach" in lines[1] and "device" not in lines[1], lines
    assert len(lines) == 7, lines  # title, header, rule, per peer: its name and row, then its short id
    assert lines[3].split()[0] == "alice" and lines[3].rstrip().endswith("client"), lines
    assert lines[5].split()[0] == "bob" and lines[5].rstrip().endswith("unverified"), lines
    assert "failed (2 in all)" in lines[3], lines
    assert all(len(line) <= 80 for line in lines)


def test_a_solo_round_is_not_shown_as_failed():
    rows = [row(name="alone", last_round_ok=False, last_round_group_size=1),
            row(name="pair", last_round_ok=False, last_round_group_size=2, failed_rounds=1)]
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(render_table(rows, "my-run", 200))
    alone, pair = (next(line for line in out.getvalue().splitlines() if name in line) for name in ("alone", "pair"))
    assert "solo" in alone and "failed" not in alone, alone
    assert "failed (1 in all)" in pair, pair
