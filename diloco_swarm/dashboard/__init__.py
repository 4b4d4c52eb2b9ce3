"""Swarm dashboard: reads the peers' signed DHT records and serves a page, a JSON API and metrics.

- :mod:`.state`: peers (online/stale/gone), totals, bounded history persisted as JSON;
- :mod:`.render`: the HTML page (no external asset);
- :mod:`.charts`: number formatting, the escape for peer-supplied text, the SVG line charts;
- :mod:`.metrics`: Prometheus text via ``prometheus_client``;
- :mod:`.app`: the Starlette app and the DHT poller.
"""

from diloco_swarm.dashboard.state import SwarmState, summarize

__all__ = ["SwarmState", "summarize"]
