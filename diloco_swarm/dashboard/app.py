"""The dashboard web app (Starlette) and the DHT poller that feeds it.

Routes: ``/`` (the page), ``/fragment`` (its live part, for the page's refresh script),
``/api/v1/state`` (JSON, see docs/dashboard.md), ``/peer/{peer_id}`` and ``/api/v1/peer/{peer_id}`` (one
volunteer's page and its JSON; 404 for a peer no record names), ``/metrics`` (Prometheus text), ``/healthz``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from diloco_swarm import __version__
from diloco_swarm.dashboard.metrics import CONTENT_TYPE, make_registry, render_metrics
from diloco_swarm.dashboard.render import content_security_policy, render_live, render_page, render_peer_page
from diloco_swarm.dashboard.state import SwarmState
from diloco_swarm.dht.records import MAX_PEER_ID, PeerEntry

logger = logging.getLogger(__name__)

Reader = Callable[[], "Iterable[PeerEntry] | None"]


class Poller:
    """Calls ``reader`` every ``poll_s`` seconds in a daemon thread and feeds ``state``;
    saves the history every ``save_s`` seconds and on stop."""

    def __init__(self, state: SwarmState, reader: Reader, poll_s: float = 3.0, save_s: float = 30.0):
        self.state, self.reader, self.poll_s, self.save_s = state, reader, poll_s, save_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> None:
        try:
            entries = self.reader()
        except Exception as e:  # the reader should not raise; never let the thread die
            logger.warning(f"dashboard poll failed: {e!r}")
            entries = None
        self.state.update(entries)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dashboard-poller", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        last_save = time.monotonic()
        while not self._stop.is_set():
            self.poll_once()
            if time.monotonic() - last_save >= self.save_s:
                self.state.save()
                last_save = time.monotonic()
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.state.save()


def create_app(state: SwarmState, poller: Poller | None = None, *, refresh_s: float = 5.0) -> Starlette:
    """The ASGI app. With a ``poller``, it runs while the app is served (lifespan)."""
    registry = make_registry(state)
    csp = content_security_policy(refresh_s)
    security = {
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cache-Control": "no-store",
    }

    async def page(request: Request) -> Response:
        html = render_page(state.snapshot(), refresh_s=refresh_s, version=__version__)
        return HTMLResponse(html, headers={**security, "Content-Security-Policy": csp})

    async def fragment(request: Request) -> Response:
        return HTMLResponse(render_live(state.snapshot()), headers={**security, "Content-Security-Policy": csp})

    async def api_state(request: Request) -> Response:
        history = request.query_params.get("history", "1") not in ("0", "false", "no")
        return JSONResponse(state.snapshot(history=history), headers=security)

    def _peer(request: Request) -> tuple[str, dict | None]:
        peer_id = request.path_params["peer_id"]
        return peer_id, (state.peer_doc(peer_id) if len(peer_id) <= MAX_PEER_ID else None)

    async def peer_page(request: Request) -> Response:
        peer_id, doc = _peer(request)
        return HTMLResponse(render_peer_page(doc, peer_id=peer_id, run_id=state.run_id, version=__version__),
                            status_code=404 if doc is None else 200,
                            headers={**security, "Content-Security-Policy": csp})

    async def api_peer(request: Request) -> Response:
        peer_id, doc = _peer(request)
        if doc is None:
            return JSONResponse({"error": f"no record of peer {peer_id[:MAX_PEER_ID]} in run {state.run_id}"},
                                status_code=404, headers=security)
        return JSONResponse(doc, headers=security)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE, headers=security)

    async def favicon(request: Request) -> Response:
        return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok", headers=security)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if poller is not None:
            poller.start()
        try:
            yield
        finally:
            if poller is not None:
                poller.stop()

    return Starlette(
        routes=[
            Route("/", page),
            Route("/fragment", fragment),
            Route("/api/v1/state", api_state),
            Route("/peer/{peer_id}", peer_page),
            Route("/api/v1/peer/{peer_id}", api_peer),
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/favicon.ico", favicon),
        ],
        lifespan=lifespan,
    )
