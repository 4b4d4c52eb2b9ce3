"""``diloco-node probe``: dial one peer with the light client and say what a volunteer needs to debug a connection."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from diloco_swarm.cli.common import fail
from diloco_swarm.cli.text import printable

PROBE_TIMEOUT_S = 5.0
UNREACHABLE = 1


def probe(
    maddr: Annotated[str, typer.Argument(help="The peer to dial: /ip4/HOST/tcp/PORT/p2p/PEER_ID, as a node prints it.")],
    run_id: Annotated[Optional[str], typer.Option(help="The run to look the peer up in (default: the run its averager serves, if it shows one).")] = None,
    timeout: Annotated[float, typer.Option(min=0.1, max=600.0, help="Seconds to wait for the dial, and again for the DHT calls.")] = PROBE_TIMEOUT_S,
    json_output: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Dial one peer with the light client (no hivemind, no Go daemon): reachable or not, round-trip time, its protocols, and its run id and outer step if it is a node of ours.

    Exit code 0 when the peer answered, 1 when it did not within --timeout, 2 on bad input.
    """
    # lazy: every command, --help included, imports this module (cli/app.py); these take ~0.15 s
    from diloco_swarm.light.client import LightError
    from diloco_swarm.light.reader import probe as run_probe
    from diloco_swarm.spec import run_id_problem

    if run_id is not None and run_id_problem(run_id):
        raise fail(run_id_problem(run_id))
    try:
        result = run_probe(maddr, run_id=run_id, timeout_s=timeout)
    except LightError as e:  # a bad address: unreachable peers come back as a result
        raise fail(str(e))
    except Exception as e:  # libp2p internals: still one line, and "not reachable"
        raise fail(f"probe failed: {e!r}"[:300], code=UNREACHABLE)
    if json_output:
        print(json.dumps(result.as_dict(), indent=2, allow_nan=False))
    else:
        _print(result, Console(highlight=False))
    if not result.reachable:
        raise typer.Exit(UNREACHABLE)


def _print(r, out: Console) -> None:
    # Everything below comes from the peer: printable() drops control characters, Text() keeps [brackets] literal.
    if not r.reachable:
        out.print(Text(f"unreachable: {printable(r.error or 'no answer')}", style="red"), soft_wrap=True)
        return
    line = Text("reachable", style="green")
    line.append(f"  peer {r.peer_id}  dial {1000 * r.connect_s:.1f} ms")
    if r.rtt_s is not None:
        line.append(f"  DHT ping {1000 * r.rtt_s:.1f} ms")
    out.print(line, soft_wrap=True)
    if r.run_ids:
        node = Text("run " + ", ".join(printable(x) for x in r.run_ids))
        if r.outer_step is not None:
            node.append(f"  outer step {r.outer_step}")
            if r.name:
                node.append(f"  name {printable(r.name)}")
        else:
            node.append("  (no record of this peer found)")
        out.print(node, soft_wrap=True)
    elif not r.dht_node:
        out.print(Text(f"not a DHT node of ours{': ' + printable(r.error) if r.error else ''}"), soft_wrap=True)
    else:
        out.print(Text("a hivemind DHT node; no run id shown (a client-mode node, or give --run-id)"), soft_wrap=True)
    out.print(Text(f"protocols ({len(r.protocols)}):"))
    for p in r.protocols:
        out.print(Text("  " + printable(p)), soft_wrap=True)
