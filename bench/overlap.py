"""``overlap``: tokens per wall second of 2 peers behind slow links, overlapped vs blocking rounds vs alone.

Two real nodes, each in its own network namespace of a ``tc tbf``-limited star (tests/natlib.py), three times in
the same namespaces: ``overlap`` (one run id, ``--sync-mode overlap``), ``blocking`` (``--sync-mode blocking``),
``alone`` (each node its own run id, side by side). Per peer, over its steady window (:func:`bench.nodes.steady_window`):
tokens/s and the ratios to the alone run, the lone-peer ratio (the alone node's inner-step share of wall time) and
the averaging's CPU per round (/proc, charged to the window, minus the alone run's). At full size H is sized at
run time so that one round's int8 transfer takes a third of an inner phase (:func:`sized_inner_steps`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import exits_md, f, human_bytes, loadavg, md_table, notes_md, ratio
from bench.nodes import NodeSpec, run_nodes, scratch, steady_window, window_figures

MODES = ("overlap", "blocking", "alone")
SIZES = {
    "smoke": {"model": "tiny", "H": 4, "seq_len": 32, "batch": 2, "rate": "100mbit", "outer_steps": 5,
              "max_bytes": 200_000, "timeout": 240},
    "quick": {"model": "tiny", "H": 20, "seq_len": 64, "batch": 4, "rate": "20mbit", "outer_steps": 6,
              "max_bytes": 1_000_000, "timeout": 400, "keep_logs": True},
    "full": {"model": "small", "H": 20, "seq_len": 64, "batch": 4, "rate": "20mbit", "outer_steps": 7,
             "max_bytes": 4_000_000, "timeout": 1200, "keep_logs": True, "size_H": True},
}
PHASE_PER_TRANSFER = 3.0  # issue 12: one round's transfer takes about a third of an inner phase
MATCHMAKING_S = 2.0
AVERAGING_WINDOW_S = 30.0
PEERS = 2


def node_args(cfg: dict[str, Any], mode: str) -> list[str]:
    """The flags of one node in ``mode`` (run id, host, port, state and metrics apart)."""
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", "int8",
            "--sync-mode", "blocking" if mode == "blocking" else "overlap",
            "--matchmaking-time", str(MATCHMAKING_S), "--averaging-window", str(AVERAGING_WINDOW_S),
            "--target-group-size", str(PEERS), "--max-dataset-bytes", str(cfg["max_bytes"]),
            "--max-outer-steps", str(cfg["outer_steps"]), "--device", "cpu", "--threads", "1",
            *(["--wait-for-peers", str(PEERS)] if mode != "alone" else [])]


def run_mode(cfg: dict[str, Any], mode: str, placements: list[tuple[list[str], str]], tag: str) -> dict[str, Any]:
    load, t0 = loadavg(), time.time()
    with scratch("overlap", mode, cfg.get("keep_logs")) as workdir:
        specs = [NodeSpec(f"peer-{i}", f"bench-overlap-{tag}-{mode}" + (f"-{i}" if mode == "alone" else ""),
                          node_args(cfg, mode), wrap, host) for i, (wrap, host) in enumerate(placements)]
        runs = run_nodes(specs, workdir, cfg["timeout"])
        peers = [window_figures(r, steady_window(r.records(), None if mode == "alone" else PEERS)) for r in runs]
    return {"mode": mode, "loadavg_start": load, "elapsed_s": round(time.time() - t0, 1), "peers": peers}


def sized_inner_steps(cfg: dict[str, Any], timed_steps: int = 8) -> dict[str, Any]:
    """H such that one round's int8 transfer at ``cfg["rate"]`` takes 1/:data:`PHASE_PER_TRANSFER` of an inner
    phase, from an inner step timed here with one thread on random tokens. A 2-peer round sends each peer's half
    of Δ and its half of the average: one int8 copy of the model (``codec.wire_bytes`` per tensor)."""
    from diloco_swarm.averaging.codec import wire_bytes
    from diloco_swarm.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg["model"], seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (cfg["batch"], cfg["seq_len"]))
        times = []
        for _ in range(3 + timed_steps):  # 3 warm-up steps
            t0 = time.perf_counter()
            _, loss = model(x, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    step_s = sorted(times[3:])[timed_steps // 2]
    sent = sum(wire_bytes(p.numel()) for p in model.parameters())
    rate = cfg["rate"].removesuffix("bit")
    transfer_s = 8 * sent / (float(rate[:-1]) * {"g": 1e9, "m": 1e6, "k": 1e3}[rate[-1]])
    H = max(cfg["H"], math.ceil(PHASE_PER_TRANSFER * transfer_s / step_s))
    return {"H": H, "step_s": round(step_s, 4), "transfer_s": round(transfer_s, 2), "wire_bytes": sent}


def run(size: str) -> dict[str, Any]:
    from tests.natlib import netns_check, star_topology, tc_qdisc_kinds

    cfg = SIZES[size]
    if cfg.get("size_H"):
        sizing = sized_inner_steps(cfg)
        cfg = {**cfg, "H": sizing["H"], "H_sizing": sizing}
    ok, why = netns_check()
    limited = ok and tc_qdisc_kinds()["tbf"]
    tag, modes = str(int(time.time())), {}
    for mode in MODES:
        if ok:
            with star_topology(PEERS, cfg["rate"] if limited else None, subnet="10.124.0") as peers:
                modes[mode] = run_mode(cfg, mode, [(["ip", "netns", "exec", ns], addr) for ns, addr in peers], tag)
        else:
            modes[mode] = run_mode(cfg, mode, [([], "127.0.0.1")] * PEERS, tag)
    from diloco_swarm.models import build_model, num_parameters

    return {"config": cfg, "netns": ok, "netns_reason": why, "rate": cfg["rate"] if limited else None,
            "matchmaking_time": MATCHMAKING_S, "averaging_window": AVERAGING_WINDOW_S,
            "params": num_parameters(build_model(cfg["model"], seed=0)), "modes": modes}


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per peer: the ratios to the alone run and the averaging CPU per round."""
    rows = []
    for i in range(PEERS):
        o, b, a = (result["modes"][k]["peers"][i] for k in MODES)
        cpu = {}
        for mode, p in (("overlap", o), ("blocking", b)):
            if p.get("cpu_s_per_round") is not None and a.get("cpu_s_per_round") is not None:
                extra = {k: v - a["cpu_s_per_round"].get(k, 0.0)
                         for k, v in p["cpu_s_per_round"].items() if k != "training"}
                training = ((p["training_cpu_s_per_inner_step"] - a["training_cpu_s_per_inner_step"])
                            * p["window_inner_steps"] / p["window_rounds"])
                cpu[mode] = {"other_processes": sum(extra.values()), "training_process": training,
                             "total": sum(extra.values()) + training}
        row = {"peer": i, "cpu": cpu, "lone_ratio": ratio(a.get("tokens_per_s"), a.get("inner_tokens_per_s"))}
        for k, p in (("overlap", o), ("blocking", b)):
            row[f"{k}_vs_alone"] = ratio(p.get("tokens_per_s"), a.get("tokens_per_s"))
            # at equal inner-step speed: the runs are minutes apart on a shared machine, and the load changes the
            # step speed of a whole run (the utilization ratio does not move with it)
            row[f"{k}_vs_alone_equal_speed"] = ratio(p.get("utilization"), a.get("utilization"))
        rows.append(row)
    return rows


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, m = result["config"], result["modes"]
    where = ((f"every link limited to {result['rate']} each way" if result["rate"] else "**no link limit (`tc tbf` is "
              "missing here)**") if result["netns"] else f"**127.0.0.1, no link limit: network namespaces were refused "
             f"here ({result['netns_reason']})**")
    sizing = cfg.get("H_sizing")
    md = [f"Model `{cfg['model']}` ({result['params']:,} parameters), H = {cfg['H']}, seq_len {cfg['seq_len']}, batch "
          f"{cfg['batch']}, int8, {cfg['outer_steps']} outer steps, {where}."
          + (f" H sized by the run: a round sends {human_bytes(sizing['wire_bytes'])} per peer, "
             f"~{sizing['transfer_s']:.1f} s at {cfg['rate']}; one inner step took {sizing['step_s']:.3f} s here."
             if sizing else "")
          + "\n"]
    rows = [[mode, i, f(p.get("tokens_per_s"), ".0f"), f(p.get("utilization"), ".1%"), p.get("window_rounds", "–"),
             f(p.get("window_wall_s"), ".0f"), f(p.get("inner_s_per_round"), ".1f"), f(p.get("waited_s"), ".1f"),
             f(p.get("eval_s"), ".1f"), " ".join(str(x) for x in p["inner_steps"]),
             " ".join(f(x, ".1f") for x in p["round_wall_s"]),
             " ".join(f"{n}" + (f" ({lead:.1f})" if lead is not None else "") for n, lead in
                      zip(p.get("previewed_tensors", []), p.get("preview_lead_s", [])) if n is not None) or "–",
             f"{p['rounds_ok']}/{p['outer_steps']}", p["exit_code"], m[mode]["loadavg_start"]]
            for mode in MODES for i, p in enumerate(m[mode]["peers"])]
    md.append(md_table(["mode", "peer", "tokens/s", "inner share of wall", "rounds in window", "window s",
                        "inner s per round", "waited s", "eval s", "inner steps per round", "round wall s",
                        "tensors previewed (s before the apply)", "verified rounds", "exit", "load avg at start"], rows))
    rows = []
    for r in summarize(result):
        def both(key: str) -> str:
            return " / ".join(f((r["cpu"].get(k) or {}).get(key)) for k in ("overlap", "blocking"))
        rows.append([r["peer"], f"{f(r['overlap_vs_alone'])}×", f"{f(r['blocking_vs_alone'])}×",
                     f"**{f(r['overlap_vs_alone_equal_speed'])}×**", f"{f(r['blocking_vs_alone_equal_speed'])}×",
                     f"**{f(r['lone_ratio'], '.3f')}**", both("total"), both("other_processes"), both("training_process")])
    md.append("\n" + md_table(["peer", "overlap ÷ alone, tokens/s", "blocking ÷ alone, tokens/s",
                               "overlap ÷ alone at equal step speed", "blocking ÷ alone at equal step speed",
                               "lone-peer ratio", "averaging CPU s per round, overlap / blocking",
                               "… of it in forked processes + p2pd", "… of it in the training process"], rows))
    md.append(notes_md(result))
    md.append(exits_md((f"{mode}, peer {i}", p) for mode in MODES for i, p in enumerate(m[mode]["peers"])))
    return "\n".join(md)
