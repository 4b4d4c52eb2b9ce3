"""A stand-in for `diloco-node join` in tests/test_demo_signals.py: it writes the start event the demo
waits for, prints a node's "to join from" hint, records every SIGINT/SIGTERM it gets in STATE_DIR/signals,
and stops like a node.

FAKE_NODE_MODE=graceful: the first SIGINT/SIGTERM stops it (exit 0) after 0.5 s of "checkpoint writing";
a second one during that time quits at once (exit 130), as a real node does.
FAKE_NODE_MODE=stubborn: it keeps running after a SIGINT; SIGTERM quits (exit 130).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def option(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


state_dir, metrics = Path(option("--state-dir")), Path(option("--metrics-file"))
state_dir.mkdir(parents=True, exist_ok=True)
mode = os.environ.get("FAKE_NODE_MODE", "graceful")
stop_requested = []


def finish(code: int) -> None:
    (state_dir / "exit").write_text(str(code))
    os._exit(code)


def handle(signum, frame) -> None:
    with open(state_dir / "signals", "a") as f:
        f.write(signal.Signals(signum).name + "\n")
    if stop_requested or (mode == "stubborn" and signum == signal.SIGTERM):
        finish(130)
    if mode == "graceful":
        stop_requested.append(signum)


signal.signal(signal.SIGINT, handle)
signal.signal(signal.SIGTERM, handle)
with open(metrics, "a") as f:
    f.write(json.dumps({"event": "start", "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmFakeNode"]}) + "\n")
(state_dir / "pid").write_text(str(os.getpid()))
# a real node's hint, which the demo passes on with the command that runs diloco-node from its shell
print("to join from this machine: diloco-node join --run-id demo-fake --initial-peers /ip4/127.0.0.1/tcp/1/p2p/QmFakeNode",
      flush=True)
while not stop_requested:
    time.sleep(0.05)
time.sleep(0.5)  # the checkpoint write of a real node
finish(0)
