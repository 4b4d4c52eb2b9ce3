"""``overlap``: tokens per wall second of 2 peers behind slow links, overlapped vs blocking vs alone.

Two real ``diloco-node join`` processes, each in its own network namespace (the star of
``bench/netutil.py``: veth pairs to a bridge in a hub namespace, ``tc tbf`` on both directions of
each peer's link), are run three times in one invocation, in the same namespaces:

- ``overlap``: one run id, ``--sync-mode overlap`` (rounds hidden behind the next inner phase);
- ``blocking``: one run id, ``--sync-mode blocking`` (training stops for every round);
- ``alone``: each node its own run id (no peer to meet: a lone overlapped node skips matchmaking
  and applies its own Δ), the two side by side so that they share the CPUs as the pair does.

Per peer, over its steady window (:func:`bench.nodes.steady_window`: from the first round averaged
by both peers, or the alone node's second round, to its second-to-last round):

- *tokens/s* = tokens of the rounds applied in the window ÷ wall seconds of the window;
- *overlap ÷ alone*, *blocking ÷ alone*: those of the same peer (namespace, data stream);
- *lone-peer ratio* (alone run) = its tokens per wall second ÷ its tokens per inner-step second,
  i.e. the share of wall time the lone node spends in inner steps: what eval, checkpoints, record
  publishing and its (skipped) rounds cost a lone node over pure training at the same step speed;
- *averaging CPU per round*: the CPU seconds of every process of the node (/proc), charged to the
  window. Forked processes and p2pd (hivemind's averager and DHT, libp2p) per round, minus the same
  in the alone run; plus the training process's extra CPU per inner step over the alone run × inner
  steps per round (the averaging thread's codec work, digests and copies run in it). On a GPU peer
  all of this stays on the CPU, while the inner steps move to the GPU.

How the size was chosen (full): issue 12 asks for links where one round's transfer takes about a
third of an inner phase. The ``small`` preset (11.1M parameters) sends about 11 MB per peer and
round in int8 with 2 peers: ~4.5 s at 20 Mbit/s. The inner phase depends on the CPU, so H is sized
at run time from one timed inner step (:func:`sized_inner_steps`); a fixed H = 20, chosen on a
machine twice as slow, made the rounds 1.5-2 phases long on a faster one.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_OUT, human_bytes, loadavg, md_table
from bench.nodes import NodeSpec, keep_logs, run_nodes, steady_window, window_figures

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
RUNS_DIR = DEFAULT_OUT / "overlap-runs"  # the nodes' metrics and logs of the last run, to look into
AVERAGING_WINDOW_S = 30.0
PEERS = 2


def node_args(cfg: dict[str, Any], mode: str) -> list[str]:
    """The flags of one node in ``mode`` (run id, host, port, state and metrics apart)."""
    sync = "blocking" if mode == "blocking" else "overlap"
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", "int8", "--sync-mode", sync,
            "--matchmaking-time", str(MATCHMAKING_S), "--averaging-window", str(AVERAGING_WINDOW_S),
            "--target-group-size", str(PEERS), "--max-dataset-bytes", str(cfg["max_bytes"]),
            "--max-outer-steps", str(cfg["outer_steps"]), "--device", "cpu", "--threads", "1",
            *(["--wait-for-peers", str(PEERS)] if mode != "alone" else [])]


def run_mode(cfg: dict[str, Any], mode: str, placements: list[tuple[list[str], str]], tag: str) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-overlap-{mode}-"))
    load = loadavg()
    print(f"[overlap] {mode}: load average at start {load}", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        specs = [NodeSpec(f"peer-{i}", f"bench-overlap-{tag}-{mode}" + (f"-{i}" if mode == "alone" else ""),
                          node_args(cfg, mode), prefix, host) for i, (prefix, host) in enumerate(placements)]
        runs = run_nodes(specs, workdir, cfg["timeout"], log_tag=f"[overlap {mode}] ")
        peers = [window_figures(r, steady_window(r.records(), None if mode == "alone" else PEERS)) for r in runs]
    finally:
        if cfg.get("keep_logs"):
            keep_logs(workdir, RUNS_DIR / mode)
        shutil.rmtree(workdir, ignore_errors=True)
    return {"mode": mode, "loadavg_start": load, "elapsed_s": round(time.time() - t0, 1), "peers": peers}


def _bits_per_s(rate: str) -> float:
    """tc's rate ("20mbit", "100kbit", "1gbit") in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    unit = next(u for u in units if rate.endswith(u))
    return float(rate[: -len(unit)]) * units[unit]


def sized_inner_steps(cfg: dict[str, Any], timed_steps: int = 8) -> dict[str, Any]:
    """H such that one round's int8 transfer at ``cfg["rate"]`` takes about 1/:data:`PHASE_PER_TRANSFER`
    of an inner phase (issue 12's premise), from one inner step timed here with one thread (the
    nodes' ``--threads 1``) on random tokens. A fixed H drifted with the CPU: on one twice as fast,
    H = 20 made the rounds 1.5-2 phases long. A 2-peer butterfly round sends each peer's half of Δ
    and its half of the average: one int8 copy of the model (``codec.wire_bytes`` per tensor).

    :returns: ``{"H", "step_s", "transfer_s", "wire_bytes"}`` (H at least ``cfg["H"]``).
    """
    from diloco_swarm.averaging.codec import wire_bytes
    from diloco_swarm.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg["model"], seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (cfg["batch"], cfg["seq_len"]))
        times = []
        for i in range(3 + timed_steps):  # 3 warm-up steps
            t0 = time.perf_counter()
            _, loss = model(x, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    step_s = sorted(times)[len(times) // 2]
    sent = sum(wire_bytes(p.numel()) for p in model.parameters())
    transfer_s = 8 * sent / _bits_per_s(cfg["rate"])
    H = max(cfg["H"], math.ceil(PHASE_PER_TRANSFER * transfer_s / step_s))
    return {"H": H, "step_s": round(step_s, 4), "transfer_s": round(transfer_s, 2), "wire_bytes": sent}


def run(size: str) -> dict[str, Any]:
    from bench.netutil import netns_check, star_topology, tc_qdisc_kinds

    cfg = SIZES[size]
    if cfg.get("size_H"):
        sizing = sized_inner_steps(cfg)
        cfg = {**cfg, "H": sizing["H"], "H_sizing": sizing}
        print(f"[overlap] H = {sizing['H']}: one inner step {sizing['step_s']:.3f} s here, a round's transfer "
              f"~{sizing['transfer_s']:.1f} s at {cfg['rate']}", file=sys.stderr, flush=True)
    ok, why = netns_check()
    qdiscs = tc_qdisc_kinds() if ok else {"tbf": False, "netem": False}
    limited = ok and qdiscs["tbf"]
    tag = str(int(time.time()))
    modes = {}
    for mode in MODES:
        if ok:
            with star_topology(PEERS, cfg["rate"] if limited else None, subnet="10.124.0") as peers:
                placements = [(["ip", "netns", "exec", ns], addr) for ns, addr in peers]
                modes[mode] = run_mode(cfg, mode, placements, tag)
        else:
            modes[mode] = run_mode(cfg, mode, [([], "127.0.0.1")] * PEERS, tag)
    from diloco_swarm.models import build_model, num_parameters

    result = {"config": cfg, "netns": ok, "netns_reason": why, "rate": cfg["rate"] if limited else None,
              "matchmaking_time": MATCHMAKING_S, "averaging_window": AVERAGING_WINDOW_S,
              "params": num_parameters(build_model(cfg["model"], seed=0)), "modes": modes}
    result["summary"] = summarize(result)
    for line in summary_lines(result):
        print(f"[overlap] {line}", file=sys.stderr, flush=True)
    return result


def _size_choice(cfg: dict[str, Any]) -> str:
    sizing = cfg.get("H_sizing")
    if sizing is None:  # runs before H was sized at run time
        return ("Size choice: a 2-peer int8 round of the `small` preset moves ~11 MB per peer, ~4.5 s at 20 Mbit/s; "
                "a first run with H = 50 measured 11-13 s per round and ~2 s per inner step (both peers on this shared "
                "2-core machine at a load average of ~11), so H = 20 makes the round about a third of a phase (compare "
                "*round wall s* with *inner s per round* below).")
    return (f"Size choice, made by the run: H is sized so that one round's transfer takes about a third of an inner "
            f"phase (issue 12's premise): a 2-peer int8 round sends {human_bytes(sizing['wire_bytes'])} per peer, "
            f"~{sizing['transfer_s']:.1f} s at {cfg['rate']}; one inner step took {sizing['step_s']:.3f} s here (one "
            f"thread, timed before the runs), so H = ⌈{PHASE_PER_TRANSFER:g} × transfer ÷ step⌉ = {cfg['H']} (compare "
            f"*round wall s* with *inner s per round* below).")


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per peer: the ratios of the module docstring; and the averaging CPU per round."""
    m = result["modes"]
    rows = []
    for i in range(PEERS):
        o, b, a = (m[k]["peers"][i] for k in MODES)
        cpu = {}
        for mode, p in (("overlap", o), ("blocking", b)):
            if p.get("cpu_s_per_round") is None or a.get("cpu_s_per_round") is None:
                cpu[mode] = None
                continue
            extra = {k: v - a["cpu_s_per_round"].get(k, 0.0) for k, v in p["cpu_s_per_round"].items()
                     if k != "training"}
            steps_per_round = p["window_inner_steps"] / p["window_rounds"]
            training_extra = (p["training_cpu_s_per_inner_step"] - a["training_cpu_s_per_inner_step"]) * steps_per_round
            cpu[mode] = {"other_processes": sum(extra.values()), "training_process": training_extra,
                         "total": sum(extra.values()) + training_extra, "by_process": extra}
        rows.append({
            "peer": i,
            "tokens_per_s": {k: p.get("tokens_per_s") for k, p in zip(MODES, (o, b, a))},
            "overlap_vs_alone": _ratio(o.get("tokens_per_s"), a.get("tokens_per_s")),
            "blocking_vs_alone": _ratio(b.get("tokens_per_s"), a.get("tokens_per_s")),
            # the same ratios at equal inner-step speed: the runs are minutes apart on a shared machine, and
            # what else runs there changes the step speed of a whole run (the CPU per step does not change)
            "overlap_vs_alone_equal_speed": _ratio(o.get("utilization"), a.get("utilization")),
            "blocking_vs_alone_equal_speed": _ratio(b.get("utilization"), a.get("utilization")),
            "inner_tokens_per_s": {k: p.get("inner_tokens_per_s") for k, p in zip(MODES, (o, b, a))},
            "training_cpu_s_per_inner_step": {k: p.get("training_cpu_s_per_inner_step")
                                              for k, p in zip(MODES, (o, b, a))},
            "lone_ratio": _ratio(a.get("tokens_per_s"), a.get("inner_tokens_per_s")),
            "averaging_cpu_s_per_round": cpu,
        })
    return {"peers": rows}


def _f(x, spec=".2f", suffix=""):
    return f"{x:{spec}}{suffix}" if x is not None else "–"


def summary_lines(result: dict[str, Any]) -> list[str]:
    out = []
    for r in result["summary"]["peers"]:
        t = r["tokens_per_s"]
        cpu = r["averaging_cpu_s_per_round"].get("overlap") or {}
        out.append(f"peer {r['peer']}: tokens/s overlap {_f(t['overlap'], '.0f')}, blocking {_f(t['blocking'], '.0f')}, "
                   f"alone {_f(t['alone'], '.0f')}; overlap ÷ alone {_f(r['overlap_vs_alone'])} (target ≥ 0.95), "
                   f"blocking ÷ alone {_f(r['blocking_vs_alone'])}; at equal inner-step speed "
                   f"{_f(r.get('overlap_vs_alone_equal_speed'))} and {_f(r.get('blocking_vs_alone_equal_speed'))}; lone-peer ratio {_f(r['lone_ratio'], '.3f')} "
                   f"(target ≥ 0.97); averaging CPU per round (overlap) {_f(cpu.get('total'), '.2f', ' s')}")
    return out


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg = result["config"]
    m = result["modes"]
    result = {**result, "summary": summarize(result)}  # figures added since the run are derived again
    if result["netns"]:
        where = (f"{PEERS} `diloco-node join` processes, each in its own network namespace (veth pairs to a bridge in "
                 f"a hub namespace)" + (f", every link limited to {result['rate']} each way with `tc tbf`."
                                        if result["rate"] else ", **with no link limit (`tc tbf` is missing here)**."))
    else:
        where = (f"**Network namespaces were refused here ({result['netns_reason']})**, so the {PEERS} nodes ran on "
                 "127.0.0.1 with no link limit.")
    md = [
        f"{where} Three runs in one invocation, in the same namespaces: **overlap** (one run, `--sync-mode overlap`), "
        f"**blocking** (one run, `--sync-mode blocking`), **alone** (each node its own run id, both side by side so "
        f"they share the CPUs as the pair does; a lone overlapped node skips matchmaking and applies its own Δ).\n",
        f"Run: model `{cfg['model']}` ({result['params']:,} parameters), H = {cfg['H']}, seq_len {cfg['seq_len']}, "
        f"batch {cfg['batch']}, int8, {cfg['outer_steps']} outer steps, matchmaking {result['matchmaking_time']} s, "
        f"`--device cpu --threads 1`. {_size_choice(cfg)}\n",
        "*Tokens/s* = tokens of the rounds applied in the steady window ÷ its wall seconds (window: from the first "
        "round both peers averaged, or the alone node's second round, to the second-to-last round: with "
        "`--max-outer-steps` the last round has no phase to hide behind). *Lone-peer ratio* = the alone node's "
        "tokens per wall second ÷ its tokens per inner-step second (= inner-step share of wall time: what evaluation, "
        "checkpoints, records and the skipped rounds cost a lone node against pure training at its own step speed). "
        "*Waited* = seconds the training thread waited for rounds in the window (`averaging_total_s`). "
        "*Tensors previewed*: per round, how many of the model's tensors of the average reached θ_local as they "
        "arrived, before the round was verified, and how many seconds before its apply the first did "
        "(`previewed_tensors`, `preview_lead_s`).\n",
    ]
    rows = []
    for mode in MODES:
        for i, p in enumerate(m[mode]["peers"]):
            rows.append([mode, i, _f(p.get("tokens_per_s"), ".0f"), _f(p.get("utilization"), ".1%"),
                         f"{p.get('window_rounds', '–')}", _f(p.get("window_wall_s"), ".0f"),
                         _f(p.get("inner_s_per_round"), ".1f"),
                         _f(p.get("waited_s"), ".1f"), _f(p.get("eval_s"), ".1f"),
                         " ".join(str(x) for x in p["inner_steps"]),
                         " ".join(_f(x, ".1f") for x in p["round_wall_s"]),
                         " ".join(f"{n}" + (f" ({lead:.1f})" if lead is not None else "")
                                  for n, lead in zip(p.get("previewed_tensors", []), p.get("preview_lead_s", []))
                                  if n is not None) or "–",
                         f"{p['rounds_ok']}/{p['outer_steps']}", p["exit_code"], m[mode]["loadavg_start"]])
    md.append(md_table(["mode", "peer", "tokens/s", "inner share of wall", "rounds in window", "window s",
                        "inner s per round",
                        "waited s", "eval s", "inner steps per round", "round wall s",
                        "tensors previewed (s before the apply)", "verified rounds",
                        "exit", "load avg at start"], rows))
    rows = []
    for r in result["summary"]["peers"]:
        cpu = r["averaging_cpu_s_per_round"]
        rows.append([r["peer"], f"{_f(r['overlap_vs_alone'])}×", f"{_f(r['blocking_vs_alone'])}×",
                     f"**{_f(r['overlap_vs_alone_equal_speed'])}×**", f"{_f(r['blocking_vs_alone_equal_speed'])}×",
                     " / ".join(_f(r["inner_tokens_per_s"][k], ".0f") for k in MODES),
                     " / ".join(_f(r["training_cpu_s_per_inner_step"][k], ".2f") for k in MODES),
                     f"**{_f(r['lone_ratio'], '.3f')}**",
                     " / ".join(_f((cpu.get(k) or {}).get("total"), ".2f") for k in ("overlap", "blocking")),
                     " / ".join(_f((cpu.get(k) or {}).get("other_processes"), ".2f") for k in ("overlap", "blocking")),
                     " / ".join(_f((cpu.get(k) or {}).get("training_process"), ".2f") for k in ("overlap", "blocking"))])
    md.append("\n" + md_table(["peer", "overlap ÷ alone, tokens/s", "blocking ÷ alone, tokens/s",
                               "overlap ÷ alone at equal step speed (target ≥ 0.95)",
                               "blocking ÷ alone at equal step speed",
                               "inner-step speed, tokens per inner s: overlap / blocking / alone",
                               "training-process CPU s per inner step: overlap / blocking / alone",
                               "lone-peer ratio (target ≥ 0.97)", "averaging CPU s per round, overlap / blocking",
                               "… of it in forked processes + p2pd", "… of it in the training process"], rows))
    md.append("\n*At equal step speed* = the ratio of the inner-step shares of wall time (tokens per wall second ÷ "
              "tokens per inner-step second), i.e. the tokens/s ratio had both runs' inner steps run at the same speed. "
              "The three runs are minutes apart on a machine shared with other jobs: when the load changes between "
              "them, the inner steps of a whole run slow down (in wall time, and on a shared host sometimes in CPU "
              "seconds per step too: see the table), and the plain tokens/s ratio measures that, not the averaging. The inner-step speed "
              "column shows how far apart the runs were; when it differs, read the equal-speed ratio. It does not "
              "charge the averaging's CPU competing with the inner steps: that is in the next columns.\n")
    md.append("\n*Averaging CPU per round*: CPU seconds (/proc, user + system) of the node's forked processes "
              "(hivemind's DHT and averager) and p2pd per round, minus the same in the alone run, plus the training "
              "process's extra CPU per inner step over the alone run × inner steps per round (the averaging thread "
              "runs in it). A GPU peer pays this on its CPU while its inner steps run on the GPU; on this 2-core "
              "machine it competes with CPU training, which is why overlap ÷ alone can fall short of 1. It reads "
              "negative when the alone run's inner steps took more CPU each than the others': then it measures that "
              "drift.\n")
    for note in result.get("notes", []):  # a reading of the run, added to its JSON afterwards
        md.append(f"\n*Note:* {note}\n")
    problems = []
    for mode in MODES:
        for i, p in enumerate(m[mode]["peers"]):
            if p["exit_code"] != 0:
                last = (p.get("log_tail") or "").strip().splitlines()[-1:] or ["(no output)"]
                problems.append(f"- {mode}, peer {i} exited {p['exit_code']}: `{last[0][:160]}`")
            if p.get("tokens_per_s") is None:
                problems.append(f"- {mode}, peer {i}: no steady window (too few rounds"
                                + (" averaged by both peers" if mode != "alone" else "") + ")")
            if p["reasons"] and mode != "alone":
                problems.append(f"- {mode}, peer {i}: rounds not verified: " + "; ".join(x[:100] for x in p["reasons"][:3]))
    if problems:
        md.append("\nWhat went wrong in this run:\n\n" + "\n".join(problems) + "\n")
    return "\n".join(md)
