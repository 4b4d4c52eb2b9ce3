"""``/metrics``: the swarm state as Prometheus text, made with ``prometheus_client``.

A custom collector on a private registry: every scrape reads the current :class:`SwarmState`,
so nothing global is mutated and gone peers' series disappear with them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from diloco_swarm.dashboard.state import STATES, SwarmState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SwarmCollector:
    def __init__(self, state: SwarmState):
        self.state = state

    def collect(self):
        doc = self.state.snapshot(history=False)
        totals: dict[str, Any] = doc["totals"]
        run = doc["run_id"]

        peers = GaugeMetricFamily("diloco_peers", "Peers of the run by state (online, stale, gone).",
                                  labels=["run_id", "state"])
        for state in STATES:
            peers.add_metric([run, state], totals[f"peers_{state}"])
        yield peers

        def swarm_gauge(name: str, doc_: str, value: Any):
            g = GaugeMetricFamily(name, doc_, labels=["run_id"])
            if value is not None:
                g.add_metric([run], float(value))
            return g

        yield swarm_gauge("diloco_swarm_tokens_per_second", "Sum of online peers' training throughput.",
                          totals["tokens_per_s"])
        yield swarm_gauge("diloco_swarm_outer_step", "Newest outer step among online and stale peers.",
                          totals["newest_outer_step"])
        yield swarm_gauge("diloco_swarm_loss", "Mean last training loss of online peers.", totals["mean_loss"])
        yield swarm_gauge("diloco_swarm_eval_loss", "Mean held-out loss of online peers.", totals["mean_eval_loss"])
        yield swarm_gauge("diloco_swarm_failed_rounds", "Sum of failed averaging rounds of online and stale peers.",
                          totals["failed_rounds"])
        yield swarm_gauge("diloco_swarm_tokens", "Tokens trained by the listed peers.", totals["tokens_total"])
        yield swarm_gauge("diloco_swarm_lineages",
                          "Distinct θ_global lineages among online peers at the newest outer step two of them "
                          "passed (absent when unknown; see docs/protocol.md).", totals["lineages"])
        yield swarm_gauge("diloco_swarm_split",
                          "1 when online peers have held 2+ lineages at each of the last 3 compared outer steps.",
                          int(totals["split"]))
        yield swarm_gauge("diloco_dashboard_last_poll_ok", "1 when the last DHT poll succeeded.",
                          None if doc["last_poll_ok"] is None else int(doc["last_poll_ok"]))

        labels = ["run_id", "peer_id", "name", "owner"]
        fams = {
            "tokens_per_s": GaugeMetricFamily("diloco_peer_tokens_per_second", "Training throughput of a peer.",
                                              labels=labels),
            "outer_step": GaugeMetricFamily("diloco_peer_outer_step", "Outer step of a peer.", labels=labels),
            "loss": GaugeMetricFamily("diloco_peer_loss", "Last training loss of a peer.", labels=labels),
            "failed_rounds": GaugeMetricFamily("diloco_peer_failed_rounds", "Failed averaging rounds of a peer.",
                                               labels=labels),
            "goodput": GaugeMetricFamily("diloco_peer_goodput", "Share of wall time that advanced the model.",
                                         labels=labels),
        }
        up = GaugeMetricFamily("diloco_peer_online", "1 online, 0 stale (gone peers are not listed).", labels=labels)
        for row in doc["peers"]:
            if row["state"] == "gone":
                continue
            values = [run, str(row["peer_id"]), str(row["name"]), row["owner"]]
            up.add_metric(values, 1.0 if row["state"] == "online" else 0.0)
            for key, fam in fams.items():
                if isinstance(row.get(key), (int, float)):
                    fam.add_metric(values, float(row[key]))
        yield up
        yield from fams.values()


def make_registry(state: SwarmState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(state))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
