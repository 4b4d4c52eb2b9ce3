"""The contribution ledger: who trained how much, and how much of it other peers' records back.

A pure function of the peers' signed records (records.py), shared by ``status``, the dashboard, the
node (which keeps its last view in its checkpoint for ``export``'s model card) and the light client:
it imports neither hivemind nor torch.

Every figure in a record is its peer's own word. Two of them are backed by others: in each verified
round (averaging/results.py ``RoundResult.ok``) every member sees the group's peer ids and the weight
(tokens) each member gathered to the group, which its parts must carry, and counts them, capped as the
reducers cap them (node/stats.py ``counted_tokens``), in its record's ``rounds_with`` (its
:data:`~diloco_swarm.dht.records.MAX_PARTNERS` most recent partners). A peer's **confirmed** rounds
(and tokens) are the largest count that another peer's record holds for it: a lower bound, exact
when the same partners saw all its rounds. A claim is **self-reported** when it exceeds the sum of
what all others hold for it: every verified round had another member, so no honest peer claims more,
while partners that came and went (churn, a Moshpit grid's groups) each saw only a part. A peer
whose partners left the run loses their evidence, unless the reader kept their last records (a node
does: :func:`keep_records`). A witness is a peer too: two peers in collusion can vouch for each
other (docs/decisions.md, "The contribution ledger").

    rows = leaderboard(records)                        # records: {peer_id: PeerRecord or its dict}
    kept = keep_records(kept, records)                 # a reader's memory of peers that left
    rows[0] -> {"name", "peer_id", "tokens", "confirmed_tokens", "share", "confirmed_share",
                "verified_rounds", "confirmed_rounds", "witnesses", "uptime_s", "self_reported", "why"}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Rounds a peer's claim may run ahead of its witnesses' records: each record is re-signed every 5 s,
# so a round just verified shows in the peer's record before (or after) it shows in its partners'.
LAG_ROUNDS = 2
NAME_ID_CHARS = 8  # a peer without a name is shown by the first characters of its peer id
MAX_ROWS = 1024  # as many as records.MAX_RECORDS: a reader never holds more


def _fields(record: Any) -> dict[str, Any]:
    """A record as a dict: a PeerRecord (pydantic), or a row that already is one."""
    return record if isinstance(record, Mapping) else record.dict()


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def display_name(record: Mapping[str, Any]) -> str:
    """The peer's ``name``, or the first :data:`NAME_ID_CHARS` characters of its peer id."""
    return str(record.get("name") or "") or str(record.get("peer_id") or "")[:NAME_ID_CHARS]


def latest_by_peer(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per peer id: the most recently ``updated`` (two owners may claim one peer id, as in
    records.live_records)."""
    out: dict[str, Mapping[str, Any]] = {}
    for record in records:
        peer = str(record.get("peer_id") or "")
        held = out.get(peer)
        if held is None or (record.get("updated") or 0) > (held.get("updated") or 0):
            out[peer] = record
    return list(out.values())


@dataclass(frozen=True)
class Witness:
    """What other peers' records hold for one peer: the largest counts any one of them holds (``rounds``,
    ``tokens``: at least this much happened), their sums (``rounds_sum``, ``tokens_sum``: every verified
    round of the peer had another member, so it cannot have had more) and how many records list it."""

    rounds: int = 0
    tokens: int = 0
    rounds_sum: int = 0
    tokens_sum: int = 0
    records: int = 0


def witnessed(records: Iterable[Mapping[str, Any]]) -> dict[str, Witness]:
    """peer id -> :class:`Witness` from the ``rounds_with`` of the other peers' records (a record's entry for
    itself is ignored; a record lists a peer once: its first entry counts)."""
    out: dict[str, Witness] = {}
    for record in records:
        me, seen = record.get("peer_id"), set()
        for entry in record.get("rounds_with") or ():
            peer = entry.get("peer_id")
            if not isinstance(peer, str) or peer == me or peer in seen:  # (a record is one witness of a peer)
                continue
            seen.add(peer)
            w, rounds, tokens = out.get(peer, Witness()), _count(entry.get("rounds")), _count(entry.get("tokens"))
            out[peer] = Witness(max(w.rounds, rounds), max(w.tokens, tokens), w.rounds_sum + rounds,
                                w.tokens_sum + tokens, w.records + 1)
    return out


def leaderboard(records: Mapping[str, Any] | Iterable[Any], *, first_hand: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Leaderboard rows of the run's peers, most confirmed tokens first (then tokens, then name).

    :param records: ``{peer_id: PeerRecord}`` (records.live_records), or records or their dicts (the
        rows of ``status`` and the dashboard hold every record field; of rows that claim one peer id, the
        most recently updated counts: :func:`latest_by_peer`). At most :data:`MAX_ROWS` are read.
    :param first_hand: peer ids whose rounds the reader counted itself (a node: the peers it averaged
        with, and itself): their rows say ``first_hand``.
    :returns: one dict per peer: ``name`` (display name), ``peer_id``, ``tokens`` (all it trained: its own
        word, solo rounds' included, which nobody else sees), ``verified_tokens`` (claimed: those in its
        verified rounds), ``confirmed_tokens``, ``share`` and ``confirmed_share`` (of the run's claimed /
        confirmed tokens, 0..1; None while the run has none), ``verified_rounds`` (claimed),
        ``confirmed_rounds``, ``witnesses`` (records that list it), ``uptime_s``, ``first_hand``,
        ``self_reported`` (its claims about its verified rounds exceed what all other records together
        hold for it, by more than :data:`LAG_ROUNDS` rounds: their count, or their tokens beyond
        ``LAG_ROUNDS`` rounds' worth; partners that came and went each saw a part, so the sum, not the
        largest, bounds an honest claim) and ``why`` (what is not backed; "" if nothing).
    """
    values = list(records.values()) if isinstance(records, Mapping) else list(records)
    dicts = latest_by_peer(_fields(r) for r in values)[:MAX_ROWS]
    backed = witnessed(dicts)
    known = set(first_hand)
    rows = []
    for r in dicts:
        peer = str(r.get("peer_id") or "")
        claimed_rounds, tokens = _count(r.get("verified_rounds")), _count(r.get("tokens_total"))
        claimed_tokens = _count(r.get("verified_tokens"))
        w = backed.get(peer, Witness())
        per_round = w.tokens / w.rounds if w.rounds else 0.0
        why = []
        if claimed_rounds > w.rounds_sum + LAG_ROUNDS:
            why.append(f"claims {claimed_rounds} verified rounds, others' records hold {w.rounds_sum}")
        if claimed_tokens > w.tokens_sum + LAG_ROUNDS * per_round:
            why.append(f"claims {claimed_tokens} tokens in verified rounds, others' records hold {w.tokens_sum}")
        uptime, claim = r.get("uptime_s"), claimed_tokens or tokens  # (older records carry no verified_tokens)
        rows.append({"name": display_name(r), "peer_id": peer, "tokens": tokens, "verified_tokens": claimed_tokens,
                     "confirmed_tokens": min(claim, w.tokens),
                     "verified_rounds": claimed_rounds, "confirmed_rounds": min(claimed_rounds, w.rounds) if claimed_rounds else w.rounds,
                     "witnesses": w.records, "uptime_s": float(uptime) if isinstance(uptime, (int, float)) else 0.0,
                     "first_hand": peer in known, "self_reported": bool(why), "why": "; ".join(why)})
    total, confirmed_total = sum(r["tokens"] for r in rows), sum(r["confirmed_tokens"] for r in rows)
    for row in rows:
        row["share"] = row["tokens"] / total if total else None
        row["confirmed_share"] = row["confirmed_tokens"] / confirmed_total if confirmed_total else None
    rows.sort(key=lambda r: (-r["confirmed_tokens"], -r["tokens"], r["name"], r["peer_id"]))
    return rows


LEDGER_FIELDS = ("peer_id", "name", "tokens_total", "verified_rounds", "verified_tokens", "uptime_s", "rounds_with",
                 "updated")


def keep_records(kept: Mapping[str, Mapping[str, Any]], records: Mapping[str, Any] | Iterable[Any]) -> dict[str, dict]:
    """``kept`` (peer id -> the :data:`LEDGER_FIELDS` of its last record seen) updated with ``records`` (as
    :func:`leaderboard` takes them; the most recently updated record of a peer wins): what a long-lived
    reader (a node, for its model card) remembers of peers that left, plain dicts and lists. At most
    :data:`MAX_ROWS`, the least recently updated dropped."""
    values = list(records.values()) if isinstance(records, Mapping) else list(records)
    out = {str(k): dict(v) for k, v in kept.items() if isinstance(v, Mapping)}
    for r in latest_by_peer([*out.values(), *(_fields(r) for r in values)]):
        fields = {k: r.get(k) for k in LEDGER_FIELDS}
        fields["rounds_with"] = [dict(e) for e in (r.get("rounds_with") or ()) if isinstance(e, Mapping)]
        out[str(r.get("peer_id") or "")] = fields
    if len(out) > MAX_ROWS:
        out = dict(sorted(out.items(), key=lambda kv: -(kv[1].get("updated") or 0))[:MAX_ROWS])
    return out
