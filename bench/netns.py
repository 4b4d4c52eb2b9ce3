"""``netns``: compute utilization of real ``diloco-node join`` processes behind a 100 Mbit/s link.

Each node runs in its own Linux network namespace, joined by a veth pair to a bridge in a hub
namespace (a star). With the link limit on, a ``tc tbf`` qdisc caps both directions of every
peer's link (peer egress = upload, hub egress toward the peer = download). Addresses are
10.123.0.1..n inside these namespaces only; everything is deleted in ``finally``.

Compute utilization = inner-step seconds / wall seconds, from the node's own metrics JSONL
(``inner_s``, ``wall_s``, cumulative, one record per outer step). *Steady* uses the differences
between the first and the last outer-step record (start-up, data loading and the first
matchmaking excluded); *overall* is the last record's ``goodput`` (``inner_s / wall_s`` since start).

``tc netem`` (delay, loss) is probed: when the kernel lacks it, no latency is added and the
report says so. If ``ip netns add`` is refused, the nodes run on 127.0.0.1 without any link limit
and the report says so.

Churn: the same nodes behind the same 100 Mbit/s links train for a fixed window twice, calm and
under the seeded kill/restart schedule of ``bench/churn.py`` (:func:`bench.churn.churn_schedule`,
carried out by :func:`bench.churn.run_once`: SIGKILL of a node's whole process tree, restart with
the same state dir), and the report compares their compute utilization and goodput.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import churn
from diloco_swarm.node.report import read_metrics
from bench.common import REPO, human_bytes, md_table

# churn: a window of `duration` s, calm and churn (`labels`), with bench.churn's schedule generator at
# the given cadence (`schedule`: kill every ± jitter s, back after down ± down_jitter s, none in the last
# tail s). The full size's kills are spaced to its outer step (~40-60 s on the shared 2-core machine).
SIZES = {
    "smoke": {"peers": 2, "model": "tiny", "H": 2, "seq_len": 32, "batch": 2, "outer_steps": 2,
              "runs": [("100mbit", "100mbit", "fp16")], "max_bytes": 200_000, "timeout": 240, "probe_bytes": 1 << 20,
              "churn": {"rate": "100mbit", "compression": "fp16", "duration": 22.0, "labels": ("churn",),
                        "schedule": {"every": 7.0, "jitter": 0.0, "down": 3.0, "down_jitter": 0.0, "tail": 8.0},
                        "start_timeout": 180.0}},
    "quick": {"peers": 4, "model": "tiny", "H": 10, "seq_len": 64, "batch": 4, "outer_steps": 3,
              "runs": [("no limit", None, "int8"), ("100mbit", "100mbit", "int8")], "max_bytes": 1_000_000,
              "timeout": 400,
              "churn": {"rate": "100mbit", "compression": "int8", "duration": 75.0, "labels": ("calm", "churn"),
                        "schedule": {}, "start_timeout": 300.0, "keep_logs": True}},
    "full": {"peers": 4, "model": "small", "H": 5, "seq_len": 64, "batch": 4, "outer_steps": 4,
             "runs": [("no limit", None, "int8"), ("100mbit", "100mbit", "int8"), ("100mbit", "100mbit", "fp32")],
             "max_bytes": 4_000_000, "timeout": 900,
             "churn": {"rate": "100mbit", "compression": "int8", "duration": 360.0, "labels": ("calm", "churn"),
                       "schedule": {"every": 70.0, "jitter": 15.0, "down": 20.0, "down_jitter": 4.0, "tail": 40.0},
                       "start_timeout": 600.0, "keep_logs": True}},
}
MATCHMAKING_S = 2.0
# hivemind's Python-side DEBUG lines (failed pings, matchmaking) in the churn runs' node logs; p2pd stays quiet
CHURN_NODE_ENV = {"HIVEMIND_LOGLEVEL": "DEBUG", "GOLOG_LOG_LEVEL": "error"}
CHURN_LOGS = REPO / "bench" / "out" / "netns-churn-runs"
AVERAGING_WINDOW_S = 60.0


def _node_args(cfg, compression: str) -> list[str]:
    """The training and averaging flags every node of a size gets (host, ports, state and run id apart)."""
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", compression,
            "--matchmaking-time", str(MATCHMAKING_S), "--averaging-window", str(AVERAGING_WINDOW_S),
            "--target-group-size", str(cfg["peers"]), "--max-dataset-bytes", str(cfg["max_bytes"]),
            "--device", "cpu", "--threads", "1"]


def _node_cmd(cfg, tag: str, compression: str, host: str, state: Path, metrics: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "diloco_swarm", "join",
            "--run-id", f"bench-netns-{tag}", "--host", host, *_node_args(cfg, compression),
            "--max-outer-steps", str(cfg["outer_steps"]),
            "--state-dir", str(state), "--metrics-file", str(metrics),
            *(["--wait-for-peers", str(cfg["peers"])] if _join_supports("--wait-for-peers") else []), *extra]


_HELP_CACHE: list[str] = []


def _join_supports(flag: str) -> bool:
    """Whether ``diloco-node join`` has ``flag`` (the CLI is evolving; ask its --help once)."""
    if not _HELP_CACHE:
        r = subprocess.run([sys.executable, "-m", "diloco_swarm", "join", "--help"], capture_output=True, text=True,
                           cwd=REPO, timeout=120, env={**os.environ, "COLUMNS": "200"})
        _HELP_CACHE.append(r.stdout)
    return flag in _HELP_CACHE[0]


def _run_swarm(cfg, tag: str, compression: str, placements: list[tuple[list[str], str]], workdir: Path,
               counters) -> dict[str, Any]:
    """Start the nodes (node 0 first, the others bootstrap from it), wait, collect metrics."""
    n = len(placements)
    metrics = [workdir / f"peer-{i}.jsonl" for i in range(n)]
    logs = [open(workdir / f"peer-{i}.log", "w") for i in range(n)]
    procs: list[subprocess.Popen] = []
    before = counters() if counters else None
    t0 = time.time()
    try:
        def start(i: int, extra: list[str]):
            prefix, host = placements[i]
            cmd = [*prefix, *_node_cmd(cfg, tag, compression, host, workdir / f"state-{i}", metrics[i], extra)]
            procs.append(subprocess.Popen(cmd, stdout=logs[i], stderr=subprocess.STDOUT, cwd=REPO))

        start(0, ["--port", "0"])
        deadline = time.monotonic() + 180
        maddrs: list[str] = []
        while not maddrs:
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the first node did not start:\n{(workdir / 'peer-0.log').read_text()[-3000:]}")
            maddrs = next((e.get("maddrs") or [] for e in read_metrics(metrics[0]) if e.get("event") == "start"), [])
            time.sleep(0.3)
        for i in range(1, n):
            start(i, ["--port", "0", "--initial-peers", maddrs[0]])
        deadline = time.monotonic() + cfg["timeout"]
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes did not finish {cfg['outer_steps']} outer steps in {cfg['timeout']} s")
            time.sleep(0.5)
        codes = [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for f in logs:
            f.close()
    after = counters() if counters else None
    peers = []
    for i in range(n):
        events = read_metrics(metrics[i])
        steps = [e for e in events if e.get("event") == "outer_step"]
        # steady window: from the first outer step that averaged with the whole group to the last step
        full = [j for j, e in enumerate(steps) if e.get("group_size") == n and e.get("round_ok")]
        steady, window = None, None
        if full and len(steps) - full[0] >= 2:
            a, b = steps[full[0]], steps[-1]
            dw = b["wall_s"] - a["wall_s"]
            steady = (b["inner_s"] - a["inner_s"]) / dw if dw > 0 else None
            window = [a.get("outer_step"), b.get("outer_step")]
        peers.append({
            "exit_code": codes[i],
            "outer_steps": len(steps),
            "rounds_ok": sum(1 for e in steps if e.get("round_ok")),
            "group_sizes": [e.get("group_size") for e in steps],
            "averaging_s": [e.get("averaging_s") for e in steps],
            "bytes_sent": [e.get("bytes_sent") for e in steps],
            "steady_utilization": steady,
            "steady_window_outer_steps": window,
            "reasons": [e.get("reason") for e in steps],
            "averaging_total_s": steps[-1].get("averaging_total_s") if steps else None,
            "sync_s": steps[-1].get("sync_s") if steps else None,
            "state_syncs": sum(1 for e in events if e.get("event") == "state_sync"),
            "overall_utilization": (steps[-1]["inner_s"] / steps[-1]["wall_s"]) if steps and steps[-1].get("wall_s")
            else None,
            "inner_s": steps[-1].get("inner_s") if steps else None,
            "wall_s": steps[-1].get("wall_s") if steps else None,
            "eval_loss_last": steps[-1].get("eval_loss") if steps else None,
            "log_tail": "" if codes[i] == 0 else (workdir / f"peer-{i}.log").read_text()[-2000:],
        })
    link = None
    if before and after:
        link = [{"rx": a[0] - b[0], "tx": a[1] - b[1]} for a, b in zip(after, before)]
    return {"peers": peers, "link_bytes": link, "elapsed_s": time.time() - t0}


def _probe_link(peers: list[tuple[str, str]], total: int) -> dict[str, Any] | None:
    """RTT and one TCP stream's throughput from peer 1 to peer 0 through the hub (bench.netprobe)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (ns0, addr0), (ns1, _) = peers[0], peers[1]
    server = subprocess.Popen(["ip", "netns", "exec", ns0, sys.executable, "-m", "bench.netprobe", "serve", addr0,
                               "5201"], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        server.stdout.readline()  # "ready"
        r = subprocess.run(["ip", "netns", "exec", ns1, sys.executable, "-m", "bench.netprobe", "probe", addr0, "5201",
                            str(total)], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return None
    finally:
        server.kill()
        server.wait(timeout=10)


def run(size: str) -> dict[str, Any]:
    from bench.netutil import link_bytes, netns_check, star_topology, tc_qdisc_kinds

    cfg = SIZES[size]
    ok, why = netns_check()
    qdiscs = tc_qdisc_kinds() if ok else {"tbf": False, "netem": False}
    runs = []
    plan = cfg["runs"] if ok else [("no limit", None, cfg["runs"][0][2])]  # no link limit without namespaces
    for label, rate, compression in plan:
        workdir = Path(tempfile.mkdtemp(prefix="bench-netns-"))
        try:
            tag = f"{label.replace(' ', '')}-{compression}-{int(time.time())}"
            if ok:
                if rate and not qdiscs["tbf"]:
                    raise RuntimeError("tc tbf is not available in this kernel")
                with star_topology(cfg["peers"], rate) as peers:
                    probe = _probe_link(peers, cfg.get("probe_bytes", 8 << 20))
                    placements = [(["ip", "netns", "exec", ns], addr) for ns, addr in peers]

                    def counters(peers=peers):
                        return [link_bytes(ns, f"vp{i}") or (0, 0) for i, (ns, _) in enumerate(peers)]

                    out = _run_swarm(cfg, tag, compression, placements, workdir, counters)
            else:
                placements = [([], "127.0.0.1")] * cfg["peers"]
                out = _run_swarm(cfg, tag, compression, placements, workdir, None)
                probe = None
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        runs.append({"label": label, "rate": rate, "compression": compression, "link_probe": probe, **out})
    churn_result = _run_churn(cfg, ok, qdiscs) if cfg.get("churn") else None
    from diloco_swarm.models import build_model, num_parameters

    return {"config": {k: v for k, v in cfg.items() if k not in ("runs", "churn")}, "netns": ok, "netns_reason": why,
            "qdiscs": qdiscs, "matchmaking_time": MATCHMAKING_S, "averaging_window": AVERAGING_WINDOW_S,
            "params": num_parameters(build_model(cfg["model"], seed=0)), "runs": runs, "churn": churn_result}


def _run_churn(cfg, ok: bool, qdiscs: dict[str, bool]) -> dict[str, Any]:
    """Calm vs churn for a fixed window behind the link limit, with bench.churn's schedule and runner."""
    from bench.netutil import link_bytes, star_topology

    cc = cfg["churn"]
    rate = cc["rate"] if ok else None
    if rate and not qdiscs["tbf"]:
        raise RuntimeError("tc tbf is not available in this kernel")
    names = [f"p{i}" for i in range(cfg["peers"])]
    params = churn.schedule_params(**cc["schedule"])
    schedule = churn.churn_schedule(churn.SEED, cc["duration"], names, **params)
    print(f"[netns] churn schedule (seed {churn.SEED}): {schedule}", file=sys.stderr, flush=True)
    runs = {}
    for label in cc["labels"]:
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-netns-churn-{label}-"))
        try:
            with (star_topology(cfg["peers"], rate) if ok else contextlib.nullcontext(None)) as peers:
                placements, counters = None, None
                if peers:
                    placements = {n: (["ip", "netns", "exec", ns], addr) for n, (ns, addr) in zip(names, peers)}

                    def counters(peers=peers):
                        return [link_bytes(ns, f"vp{i}") or (0, 0) for i, (ns, _) in enumerate(peers)]

                runs[label] = churn.run_once(
                    label, workdir, cc["duration"], schedule if label == "churn" else None,
                    node_args=_node_args(cfg, cc["compression"]), placements=placements, names=names,
                    run_id=f"bench-netns-{label}-{int(time.time())}", counters=counters,
                    start_timeout=cc["start_timeout"], log_prefix="netns ", env=CHURN_NODE_ENV)
        finally:
            if cc.get("keep_logs"):  # the nodes' logs and metrics, for a look at what went wrong
                dest = CHURN_LOGS / label
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(workdir, dest, ignore=shutil.ignore_patterns("*.pt", "*.key", "node.lock"))
            if not os.environ.get("BENCH_KEEP_WORKDIR"):
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                print(f"[netns] kept {workdir}", file=sys.stderr, flush=True)
    return {"rate": rate, "compression": cc["compression"], "duration_s": cc["duration"], "seed": churn.SEED,
            "schedule_params": params, "schedule": schedule, "runs": runs}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg = result["config"]
    rows = []
    for r in result["runs"]:
        peers = r["peers"]
        steps = sum(p["outer_steps"] for p in peers)
        ok = sum(p["rounds_ok"] for p in peers)
        steady = _mean(p["steady_utilization"] for p in peers)
        overall = _mean(p["overall_utilization"] for p in peers)
        avg_s = _mean(s for p in peers for s in p["averaging_s"][1:]) if steps else None
        sent = _mean(b for p in peers for b in p["bytes_sent"] if b)
        link_tx = (_mean(x["tx"] for x in r["link_bytes"]) / max(1, _mean(p["outer_steps"] for p in peers) or 1)
                   if r["link_bytes"] else None)
        rows.append([
            r["label"] if result["netns"] else "127.0.0.1 (no namespaces)", r["compression"],
            f"{steps}", f"{ok}/{steps}",
            f"{100 * steady:.1f}%" if steady is not None else "–",
            f"{100 * overall:.1f}%" if overall is not None else "–",
            f"{avg_s:.2f}" if avg_s is not None else "–",
            human_bytes(sent) if sent else "–",
            human_bytes(link_tx) if link_tx else "–",
            (f"{r['link_probe']['mbit_per_s']:.0f} Mbit/s, RTT {r['link_probe']['rtt_ms_median']:.3f} ms"
             if r.get("link_probe") else "–"),
            ", ".join(str(p["exit_code"]) for p in peers),
        ])
    if result["netns"]:
        where = (f"{cfg['peers']} `diloco-node join` processes, each in its own network namespace, joined by veth "
                 "pairs to a bridge in a hub namespace; *100mbit* = `tc qdisc tbf rate 100mbit` on both directions of "
                 "every peer's link.")
    else:
        where = (f"**Network namespaces were refused here ({result['netns_reason']})**, so the "
                 f"{cfg['peers']} nodes ran on 127.0.0.1 with no link limit.")
    netem = ("`tc netem` is **not available in this kernel** (`tc qdisc add ... netem` fails), so **no latency or "
             "loss was added**: the links are bandwidth-limited only (their RTT is in the link probe column)."
             if not result["qdiscs"].get("netem") else "`tc netem` is available but was not used (no added latency).")
    md = [
        f"{where} {netem} All {cfg['peers']} nodes share this machine's CPUs (`--threads 1` each).\n",
        f"Run: model `{cfg['model']}` ({result['params']:,} parameters), H = {cfg['H']}, seq_len {cfg['seq_len']}, "
        f"batch {cfg['batch']}, {cfg['outer_steps']} outer steps, matchmaking {result['matchmaking_time']} s, "
        f"averaging window {result['averaging_window']} s, `--device cpu`.\n",
        "Compute utilization = inner-step time / wall time from each node's metrics (`inner_s`, `wall_s`), mean "
        "over the nodes; *steady* = from the first outer step verified with the whole group to the last one "
        "(start-up, waiting for peers and solo rounds excluded; – when fewer than two such steps); *overall* = "
        "`inner_s / wall_s` at the last step, since the node started.\n",
        md_table(["link", "codec", "outer steps (all nodes)", "verified rounds", "utilization, steady",
                  "utilization, overall", "averaging s per step", "payload sent per step", "link tx per step",
                  "link probe¹", "exit codes"], rows),
        "\n¹ measured before the nodes started: one TCP stream from peer 1 to peer 0 through the hub "
        "(`bench/netprobe.py`), and the median of 50 one-byte TCP round trips.\n",
    ]
    problems = []
    for r in result["runs"]:
        reasons = sorted({x for p in r["peers"] for x in p.get("reasons", []) if x})
        if reasons:
            problems.append(f"- {r['label']}, {r['compression']}: rounds not verified: " + "; ".join(
                x[:120] for x in reasons[:4]))
        for i, p in enumerate(r["peers"]):
            if p["exit_code"] != 0:
                last = (p.get("log_tail") or "").strip().splitlines()[-1:] or ["(no output)"]
                problems.append(f"- {r['label']}, {r['compression']}: node {i} exited {p['exit_code']}: "
                                f"`{last[0][:160]}`")
    if problems:
        md.append("\nWhat went wrong in this run:\n\n" + "\n".join(problems) + "\n")
    base = next((r for r in result["runs"] if r["rate"] is None), None)
    for r in result["runs"]:
        if base is not None and r is not base and r["compression"] == base["compression"]:
            a = _mean(p["steady_utilization"] for p in base["peers"])
            b = _mean(p["steady_utilization"] for p in r["peers"])
            if a and b:
                md.append(f"\nSteady utilization with the {r['label']} limit is **{b / a:.2f}×** the unlimited one "
                          f"({r['compression']}, same run of the benchmark).\n")
    if result.get("churn"):
        md.append(_render_churn(result, cfg))
    else:
        md.append("\n### With churn\n\nNot run at this size.\n")
    return "\n".join(md)


def _render_churn(result: dict[str, Any], cfg: dict[str, Any]) -> str:
    ch = result["churn"]
    runs = [ch["runs"][k] for k in ("calm", "churn") if k in ch["runs"]]
    n, sp = cfg["peers"], ch["schedule_params"]
    link = f"`tc tbf` {ch['rate']}" if ch["rate"] else "127.0.0.1, no link limit (no namespaces here)"
    rows = []
    for r in runs:
        tx = _mean(x["tx"] for x in r["link_bytes_window"]) if r.get("link_bytes_window") else None
        rows.append([
            r["label"], link, ch["compression"],
            f"{100 * r['utilization_overall']:.1f}%" if r["utilization_overall"] is not None else "–",
            f"{100 * r['goodput_overall']:.1f}%" if r["goodput_overall"] is not None else "–",
            f"{100 * r['window_utilization']:.1f}%" if r["window_utilization"] is not None else "–",
            f"{100 * r['window_goodput']:.1f}%" if r["window_goodput"] is not None else "–",
            r["outer_steps_in_window"], f"{r['verified_rounds']}/{r['rounds']}", r["state_syncs"],
            churn.fmt(r["final_eval_loss_mean"]),
            f"{human_bytes(tx)} ({8 * tx / r['measured_s'] / 1e6:.1f} Mbit/s)" if tx else "–",
            ", ".join(f"{k} {v}" for k, v in r["leave_codes"].items()) or "–",
        ])
    md = [
        "\n### With churn\n",
        f"The same {n} nodes ({link} on every link, {ch['compression']}, the flags of the table above but "
        f"no `--max-outer-steps`) train for a fixed window of {ch['duration_s']:.0f} s, counted from the "
        f"moment all {n} have started training"
        + (": **calm** (nobody fails), and **churn**" if "calm" in ch["runs"] else " (at this size only **churn**)")
        + ": the seeded kill/restart "
        f"schedule of `bench/churn.py` (`churn_schedule`, seed {ch['seed']}; `run_once` SIGKILLs the whole process "
        f"tree of one node and restarts it with the same `--state-dir`, `--wait-for-peers 0` and every live "
        f"peer's address as `--initial-peers`), here a kill every {sp['every']:.0f} ± {sp['jitter']:.0f} s and the "
        f"node back {sp['down']:.0f} ± {sp['down_jitter']:.0f} s later"
        + (f" (the cadence is set per size in `bench/netns.py`, to the pace of its outer steps; "
           f"`python -m bench.churn` kills every {churn.KILL_EVERY_S:.0f} ± {churn.KILL_JITTER_S:.0f} s)"
           if sp["every"] != churn.KILL_EVERY_S else "")
        + f". A node that exits on its own inside the window is restarted {churn.RESTART_FAILED_AFTER_S:.0f} s later, "
        "as a supervisor would (each such exit is listed below). Then every live node gets SIGINT. The nodes log "
        "hivemind's Python-side DEBUG lines in both runs.\n",
        "*Utilization* = inner-step seconds / wall seconds and *goodput* = inner seconds whose Δ was applied "
        "(`inner_s − wasted_inner_s`) / wall seconds. *Process lives*: summed over every process life of every "
        "node (its last `outer_step` record; launch to exit, start-up included; a peer that is down has no "
        f"life). *Window × {n} slots*: the inner seconds the records place inside the window, over {n} × the "
        "window (a peer that is down or restarting is an idle slot; the steps in progress when the window "
        "ends are not counted in either run). *Rounds*: all nodes' records up to the window's end.\n",
        md_table(["run", "link", "codec", "utilization (process lives)", "goodput (process lives)",
                  f"utilization, window × {n} slots", f"goodput, window × {n} slots", "outer steps in window",
                  "verified / all rounds", "state syncs", "final held-out loss, mean", "link tx per node in window",
                  "graceful-leave exit codes"], rows),
    ]
    by = {r["label"]: r for r in runs}
    if "calm" in by and "churn" in by:
        def ratio(key):
            a, b = by["calm"][key], by["churn"][key]
            return f"{b / a:.2f}×" if a and b is not None else "–"

        md.append(f"\nWith churn, compute utilization is **{ratio('utilization_overall')}** the calm run's over the "
                  f"process lives and **{ratio('window_utilization')}** over the window's slots; goodput "
                  f"{ratio('goodput_overall')} and {ratio('window_goodput')} (same invocation, same links).\n")
    md.append("\n" + churn.syncs_md(runs) + "\n")
    md.append(f"\nSchedule (seconds after the window starts):\n\n" + churn.schedule_md(ch["schedule"],
                                                                                         by.get("churn", {}).get("actions", [])))
    problems = [x for r in runs for x in churn.problems_md(r)]
    if problems:
        md.append("\nWhat went wrong in these two runs:\n\n" + "\n".join(problems) + "\n")
    return "\n".join(md)
