"""``diloco-node dashboard``: a public web page of the swarm (Starlette + uvicorn)."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from diloco_swarm.cli.common import fail, require_finite
from diloco_swarm.cli.status import LIGHT_HELP, open_reader, parse_peers, reader_message, use_light
from diloco_swarm.cli.text import DEFAULT_RUN_ID

# Every command, --help included, imports this module (cli/app.py). "lazy": the web server and the
# records (uvicorn, Starlette, pydantic: ~0.15 s) load when the dashboard runs.


def _server_class():
    import uvicorn  # lazy

    class Server(uvicorn.Server):
        """uvicorn's server, minus re-raising SIGINT/SIGTERM after its graceful shutdown, so that
        our ``finally`` can stop the DHT process and the command exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def dashboard(
    initial_peers: Annotated[list[str], typer.Option("--initial-peers", help="Multiaddr of any node of the swarm (/ip4/HOST/tcp/PORT/p2p/PEER_ID), as printed by that node. Repeat or separate with spaces.")],
    run_id: Annotated[str, typer.Option(help="The run to show.")] = DEFAULT_RUN_ID,
    port: Annotated[int, typer.Option(min=1, max=65535, help="HTTP port of the page.")] = 8080,
    host: Annotated[str, typer.Option(help="HTTP address: 127.0.0.1 = this machine only; 0.0.0.0 = public (put a TLS proxy in front).")] = "127.0.0.1",
    state_dir: Annotated[Path, typer.Option(help="Where the chart history is kept (dashboard-history.json), so a restart keeps the charts.")] = Path("diloco-dashboard"),
    poll_s: Annotated[float, typer.Option(min=0.5, help="Seconds between two reads of the DHT.")] = 3.0,
    sample_s: Annotated[float, typer.Option(min=0.5, help="Seconds between two points of the charts (2000 points are kept per series).")] = 10.0,
    refresh_s: Annotated[float, typer.Option(min=1.0, help="Seconds between two refreshes of an open page.")] = 5.0,
    stale_after: Annotated[float, typer.Option(min=1.0, help="A peer silent this long is shown as stale (greyed).")] = 20.0,
    gone_after: Annotated[float, typer.Option(min=1.0, help="A peer silent this long is shown as gone.")] = 60.0,
    keep_gone: Annotated[float, typer.Option(min=0.0, help="Seconds a gone peer stays listed.")] = 900.0,
    light: Annotated[bool, typer.Option("--light", help=LIGHT_HELP)] = False,
) -> None:
    """Serve a live page of the swarm: totals, loss and tokens/s charts, and one row per peer.

    Joins the DHT as a client and reads the peers' signed records every few seconds. Also serves /api/v1/state (JSON, see docs/dashboard.md) and /metrics (Prometheus). Ctrl+C stops it; the chart history is saved in --state-dir.
    """
    # lazy
    from diloco_swarm.spec import run_id_problem
    from diloco_swarm.utils.net import port_problem

    require_finite(poll_s=poll_s, sample_s=sample_s, refresh_s=refresh_s, stale_after=stale_after, gone_after=gone_after,
                   keep_gone=keep_gone)
    err = Console(stderr=True, highlight=False)
    if run_id_problem(run_id):
        raise fail(run_id_problem(run_id))
    light = use_light(light)
    try:
        peers = parse_peers(initial_peers, light)
    except ValueError as e:
        raise fail(str(e))
    if port_problem(host, port):
        raise fail(reader_message(ValueError(port_problem(host, port))))
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(f"--state-dir {state_dir}: {e.strerror}")

    # lazy
    import uvicorn

    from diloco_swarm.dashboard.app import Poller, create_app
    from diloco_swarm.dashboard.state import HISTORY_FILE, SwarmState

    Server = _server_class()

    state = SwarmState(run_id, stale_after_s=stale_after, gone_after_s=gone_after, keep_gone_s=keep_gone,
                       sample_s=sample_s, path=state_dir / HISTORY_FILE)
    if state.load():
        err.print(Text(f"restored the chart history from {state.path}"))
    try:
        read, close = open_reader(peers, run_id, light)
    except ValueError as e:
        raise fail(str(e))
    try:
        poller = Poller(state, read, poll_s=poll_s)
        app = create_app(state, poller, refresh_s=refresh_s)
        shown = f"[{host}]" if ":" in host else host
        err.print(Text(f"dashboard of run '{run_id}' on http://{shown}:{port}/  (Ctrl+C to stop)"))
        server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                       server_header=False))
        server.run()
        if not server.started:
            raise fail(f"could not serve on {host}:{port}; pick another --port or --host")
    finally:
        with contextlib.suppress(Exception):
            close()
