"""``diloco-node``: join a DiLoCo training swarm, or run a local demo swarm.

Every user-facing problem ends with one line on stderr and exit code 2; nothing saved is lost.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import logging
import math
import os

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported anywhere

import shlex
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from diloco_swarm.averaging.bandwidth import MAX_CAP_MBPS, MIN_CAP_MBPS
from diloco_swarm.cli.common import USAGE_ERROR, err, fail, require_finite, require_node
from diloco_swarm.cli.dashboard import dashboard
from diloco_swarm.cli.private import invite as invite_command
from diloco_swarm.cli.probe import probe
from diloco_swarm.cli.status import status
from diloco_swarm.cli.pause import pause, resume
from diloco_swarm.cli.text import DEFAULT_RUN_ID, DEFAULT_STATE_DIR, printable
from diloco_swarm.node.inner import INNER_OPTIMIZERS

# Every command, --help included, imports this module: the imports above are what all of them need
# (typer, rich, the command modules: ~0.25 s in all). A command imports the rest when it runs (tagged
# "lazy"): torch and hivemind take seconds, pydantic ~0.1 s.


def _show_flags_bare() -> None:
    """typer 0.29's rich help prints a flag's type as if the flag took a value (``--public <bool>``,
    even ``--help <bool>``); its plain help and the parser do not. Show flags bare, as click does."""
    try:
        from typer.core import TyperOption  # inside the try: no patch where typer lacks it
    except ImportError:
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "bare_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.bare_flags = True
    TyperOption.display_type_rich = display_type_rich


_show_flags_bare()

app = typer.Typer(
    name="diloco-node",
    help=(
        "Train a shared language model with strangers' GPUs and CPUs over the internet.\n\n"
        "Each node trains locally for H inner steps, then averages its int8 pseudo-gradient with the "
        "swarm's peers found through a DHT and applies an outer Nesterov step (DiLoCo, arXiv "
        "2311.08105), training on while the round runs. Start a swarm with `diloco-node join`, or "
        "see one on this machine with `diloco-node demo`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


InnerOptimizer = Enum("InnerOptimizer", {name: name for name in INNER_OPTIMIZERS}, type=str)


# the outer step's defaults (learning rate, Nesterov momentum) by --compression: DiLoCo's for the dense codecs; a
# sparse average holds ~1% of the entries per round, and wants a longer step with less momentum (bench.sparse,
# docs/decisions.md, *Sparse int8*)
OUTER_STEP_DEFAULTS = {"int8": (0.7, 0.9), "fp16": (0.7, 0.9), "fp32": (0.7, 0.9),
                       "sparse1-int8": (3.0, 0.3), "sparse2-int8": (3.0, 0.3)}


class Compression(str, Enum):
    int8 = "int8"
    fp16 = "fp16"
    fp32 = "fp32"
    sparse1_int8 = "sparse1-int8"  # = averaging/sparse.py SPARSE_MODES (not imported here: it loads hivemind)
    sparse2_int8 = "sparse2-int8"


MAX_THREADS = 256  # --threads: far beyond any CPU node; 100,000 made the OpenMP pool exhaust memory
MAX_NAME = 64  # = dht/records.py MAX_NAME (not imported here: it loads hivemind)


class SyncMode(str, Enum):
    overlap = "overlap"
    blocking = "blocking"


SWARM = "Swarm"
TRAINING = "Training (the run spec: every peer of a run must agree)"
LOCAL = "Local"
AVERAGING = "Averaging"


@app.command()
def join(
    run_id: Annotated[Optional[str], typer.Option(help=f"Name of the training run; peers with the same run id train together. Default: {DEFAULT_RUN_ID}, shared by every node started without --run-id (each `diloco-node demo` uses its own, demo-YYYYMMDD-HHMMSS); in a private run, the run its invitation or state dir names.", show_default=False, rich_help_panel=SWARM)] = None,
    initial_peers: Annotated[Optional[list[str]], typer.Option("--initial-peers", help="Multiaddr of a running node (/ip4/HOST/tcp/PORT/p2p/PEER_ID), as printed by that node. Repeat or separate with spaces. Omit to start a new swarm.", rich_help_panel=SWARM)] = None,
    host: Annotated[str, typer.Option(help="Address to listen on. 0.0.0.0 = all interfaces; 127.0.0.1 = this machine only.", rich_help_panel=SWARM)] = "0.0.0.0",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port to listen on; 0 = any free port.", rich_help_panel=SWARM)] = 0,
    announce: Annotated[Optional[list[str]], typer.Option("--announce", help="Public multiaddr(s) other peers should dial, e.g. /ip4/203.0.113.5/tcp/31337 for a port-forwarded home PC.", rich_help_panel=SWARM)] = None,
    client_mode: Annotated[bool, typer.Option("--client-mode", help="Only dial out, skipping the reachability check (a home PC without port forwarding). A client trains and averages through public peers but reduces no parts and donates no state. Default: decided at start by a dial-back check (docs/networking.md).", rich_help_panel=SWARM)] = False,
    public: Annotated[bool, typer.Option("--public", help="Serve as a full peer without the reachability check (you know other peers can dial this node).", rich_help_panel=SWARM)] = False,
    private: Annotated[bool, typer.Option("--private", help="Start a private run: only peers with an invitation take part. Creates the organiser key in --state-dir (required); `diloco-node invite --state-dir DIR` then prints invitations. A restart with the same state dir needs no --private.", rich_help_panel=SWARM)] = False,
    invite: Annotated[Optional[str], typer.Option("--invite", metavar="TEXT_OR_FILE", help="Join a private run with this invitation (a file holding it, or its text), from its organiser's `diloco-node invite`. Saved in the state dir: a restart needs no --invite.", rich_help_panel=SWARM)] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Text file, folder or glob; or hf:NAME_OR_PATH\\[:CONFIG]\\[@SPLIT]\\[#COLUMN], a Hugging Face dataset (local parquet, JSON Lines, Arrow or text folder; Hub id streamed when online). Default: the Python standard library's source files (no download).", rich_help_panel=TRAINING)] = None,
    model: Annotated[str, typer.Option(help="tiny (~0.5M params, CPUs/tests), small (~11M), base (~100M): byte-level GPT; llama-tiny (3.3M with --tokenizer byte, more with a larger vocabulary), llama-150m, llama-1b (OpenDiLoCo's shapes): Llama, vocabulary from --tokenizer; hf:PATH_OR_ID: a causal LM config (and weights, the starting point) from a local folder or the Hub.", rich_help_panel=TRAINING)] = "tiny",
    tokenizer: Annotated[Optional[str], typer.Option(help="byte (one token per byte), a tokenizer.json, a tokenizer folder or a Hub id. Default: byte for tiny/small/base, the model folder's own for hf:, required for llama-*.", rich_help_panel=TRAINING)] = None,
    inner_steps: Annotated[int, typer.Option(min=1, help="H: inner AdamW steps between outer steps.", rich_help_panel=TRAINING)] = 500,
    seq_len: Annotated[int, typer.Option(min=8, help="Tokens (bytes) per training sequence.", rich_help_panel=TRAINING)] = 256,
    inner_lr: Annotated[float, typer.Option(help="Inner AdamW learning rate (> 0).", rich_help_panel=TRAINING)] = 1e-3,
    outer_lr: Annotated[Optional[float], typer.Option(help=f"Outer SGD learning rate (> 0). Default: {OUTER_STEP_DEFAULTS['int8'][0]:g}; {OUTER_STEP_DEFAULTS['sparse1-int8'][0]:g} with a sparse --compression.", show_default=False, rich_help_panel=TRAINING)] = None,
    outer_momentum: Annotated[Optional[float], typer.Option(min=0.0, max=0.999, help=f"Outer Nesterov momentum (0 = plain SGD). Default: {OUTER_STEP_DEFAULTS['int8'][1]:g}; {OUTER_STEP_DEFAULTS['sparse1-int8'][1]:g} with a sparse --compression.", show_default=False, rich_help_panel=TRAINING)] = None,
    compression: Annotated[Compression, typer.Option(help="Pseudo-gradient encoding on the wire: int8 (every value), or sparse1-int8 / sparse2-int8 (the top 1% / 2% of each chunk of 4096 values in int8, the rest kept as error feedback; for home uplinks).", rich_help_panel=TRAINING)] = Compression.int8,
    sync_mode: Annotated[SyncMode, typer.Option(help="overlap: keep training while the group averages, apply the outer step one round late (eager updates, arXiv 2502.12996); blocking: wait for each round (plain DiLoCo). See docs/architecture.md.", rich_help_panel=TRAINING)] = SyncMode.overlap,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the initial weights (shared) and of each peer's data order (mixed with its peer id).", rich_help_panel=TRAINING)] = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per inner step on this node.", rich_help_panel=LOCAL)] = 16,
    inner_optimizer: Annotated[InnerOptimizer, typer.Option(help="adamw: AdamW with fp32 moments (8 B/param); adamw8bit: bitsandbytes' AdamW8bit, moments in 8 bits (2 B/param), for a large model on a consumer GPU. Local to this node.", rich_help_panel=LOCAL)] = InnerOptimizer.adamw,
    device: Annotated[Device, typer.Option(help="Where the inner steps run; auto = cuda, else mps, else cpu. CUDA trains in bf16 autocast.", rich_help_panel=LOCAL)] = Device.auto,
    threads: Annotated[int, typer.Option(min=0, max=MAX_THREADS, help=f"PyTorch CPU threads (0 = PyTorch's default; at most {MAX_THREADS}). Use 1 when several nodes share a small CPU.", rich_help_panel=LOCAL)] = 0,
    max_outer_steps: Annotated[int, typer.Option(min=0, help="Stop once the outer step reaches this number: the swarm's absolute step (kept across restarts; a joiner syncs to the swarm's), not a count of steps for this run, so a node resumed at or past it trains no step. 0 = run until stopped.", rich_help_panel=LOCAL)] = 0,
    state_dir: Annotated[Optional[Path], typer.Option(help=f"Identity key, checkpoints and lock of this node (default: {DEFAULT_STATE_DIR}). One node per state dir; restart with the same dir to resume.", show_default=False, rich_help_panel=LOCAL)] = None,
    metrics_file: Annotated[Optional[Path], typer.Option(help="Append JSON Lines metrics here (one object per outer step; see docs/metrics.md).", rich_help_panel=LOCAL)] = None,
    name: Annotated[str, typer.Option(help=f"Nickname shown to other peers (at most {MAX_NAME} characters).", rich_help_panel=LOCAL)] = "",
    max_dataset_bytes: Annotated[Optional[int], typer.Option(min=1024, help="Read at most this many bytes of the dataset (faster start on big corpora).", rich_help_panel=LOCAL)] = None,
    wait_for_peers: Annotated[int, typer.Option(min=0, help="Before training, wait up to 2 minutes until this many peers (this one included) are online. 0 = start at once.", rich_help_panel=SWARM)] = 0,
    target_group_size: Annotated[int, typer.Option(min=0, help="Peers per averaging group; 0 = the whole swarm in one group (up to --max-group-size), so every peer holds one θ_global: a group must hold a majority of the online peers. Smaller groups follow a rotating grid and mix θ_global between rounds (docs/architecture.md).", rich_help_panel=AVERAGING)] = 0,
    max_group_size: Annotated[int, typer.Option(min=2, max=1024, help="Most peers in one averaging group.", rich_help_panel=AVERAGING)] = 64,
    matchmaking_time: Annotated[float, typer.Option(min=0.5, help="Seconds a group leader waits for more peers at least; it waits longer for peers whose inner phase is about to end (progress alignment).", rich_help_panel=AVERAGING)] = 2.0,
    averaging_window: Annotated[float, typer.Option(min=1.0, max=3600.0, help="Seconds to look for a group before the round counts as late (its pseudo-gradient goes into the next round; a solo outer step only when no other peer is online).", rich_help_panel=AVERAGING)] = 30.0,
    allreduce_timeout: Annotated[float, typer.Option(min=1.0, max=3600.0, help="Seconds the all-reduce may take once a group formed.", rich_help_panel=AVERAGING)] = 60.0,
    max_upload_mbps: Annotated[Optional[float], typer.Option(min=MIN_CAP_MBPS, max=MAX_CAP_MBPS, help=f"Cap this node's upload in Mbit/s (at least {MIN_CAP_MBPS:g}): every byte of its averaging rounds and state donations. Its rounds are sized to it: a smaller slice of each all-reduce, and groups wait for it. Default: no cap.", show_default=False, rich_help_panel=LOCAL)] = None,
    max_download_mbps: Annotated[Optional[float], typer.Option(min=MIN_CAP_MBPS, max=MAX_CAP_MBPS, help=f"Cap this node's download in Mbit/s (at least {MIN_CAP_MBPS:g}), likewise: averaging rounds and state downloads. Default: no cap.", show_default=False, rich_help_panel=LOCAL)] = None,
    active_hours: Annotated[Optional[str], typer.Option(metavar="HH:MM-HH:MM", help="Train only inside this daily window of local time (it may wrap midnight: 22:00-07:00); outside it the node pauses, staying in the swarm. `diloco-node pause` / `resume` pause it by hand. Default: all day.", show_default=False, rich_help_panel=LOCAL)] = None,
    eval_budget: Annotated[float, typer.Option(min=0.0, max=1.0, help="Evaluate the held-out loss after an outer step only while evaluation has taken less than this share of wall time (0.02 = 2%); the last value is reported in between.", rich_help_panel=LOCAL)] = 0.02,
) -> None:
    """Join (or start) a training swarm and train until stopped.

    Prints this node's multiaddrs; paste one into `--initial-peers` on another machine to join it.
    Ctrl+C leaves cleanly (the checkpoint is written); a second Ctrl+C quits at once.
    """
    require_node("join")
    from diloco_swarm.node.signals import catch_early  # lazy

    catch_early()  # a stop signal while torch and hivemind load is kept for the node, not lost
    # lazy
    from pydantic import ValidationError

    from diloco_swarm.node.config import NodeConfig
    from diloco_swarm.spec import RunSpec, run_id_problem

    default_lr, default_momentum = OUTER_STEP_DEFAULTS[compression.value]
    outer_lr = default_lr if outer_lr is None else outer_lr
    outer_momentum = default_momentum if outer_momentum is None else outer_momentum
    # (the run spec's floats are checked by RunSpec, the bounded ones by their ranges)
    require_finite(matchmaking_time=matchmaking_time, averaging_window=averaging_window,
                   allreduce_timeout=allreduce_timeout,
                   **{k: v for k, v in dict(max_upload_mbps=max_upload_mbps, max_download_mbps=max_download_mbps).items()
                      if v is not None})
    if target_group_size == 1:
        raise fail("--target-group-size must be 0 (the whole swarm) or at least 2")
    if target_group_size > max_group_size:
        err.print(f"warning: --target-group-size {target_group_size} is above --max-group-size {max_group_size}: "
                  f"groups hold at most {max_group_size} peers", soft_wrap=True)
    if matchmaking_time >= averaging_window:
        raise fail("--matchmaking-time must be shorter than --averaging-window")
    if client_mode and public:
        raise fail("--client-mode and --public contradict each other; give at most one")
    from diloco_swarm.node.pause import ActiveHours  # lazy (stdlib only)

    try:
        hours = None if active_hours is None else ActiveHours.parse(active_hours)
    except ValueError as e:
        raise fail(str(e))
    if len(name) > MAX_NAME:  # peer records hold at most MAX_NAME characters
        err.print(f"warning: --name is {len(name)} characters long; other peers see only its first {MAX_NAME}: "
                  f"{escape(repr(printable(name[:MAX_NAME])))}", soft_wrap=True)
        name = name[:MAX_NAME]
    try:
        spec = RunSpec(
            run_id=run_id or DEFAULT_RUN_ID,
            model=model,
            dataset="(set from the data)",
            seq_len=seq_len,
            inner_steps=inner_steps,
            inner_lr=inner_lr,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            compression=compression.value,
            seed=seed,
            sync_mode=sync_mode.value,
        )
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "run spec"
        if field == "run_id":
            raise fail(run_id_problem(run_id) or f"--run-id {run_id!r}: {first['msg']}")
        raise fail(f"--{field.replace('_', '-')} {first.get('input')!r}: {first['msg']}")
    from diloco_swarm.cli.precheck import InputError, check_join_input  # lazy

    try:  # before the slow imports below (torch, hivemind), so that bad input is refused at once
        check_join_input(initial_peers=initial_peers or [], announce=announce or [], host=host, port=port,
                         dataset=dataset, model=model, tokenizer=tokenizer, metrics_file=metrics_file)
    except InputError as e:
        raise fail(str(e))
    from diloco_swarm.cli.private import AccessError, resolve_access  # lazy
    from diloco_swarm.utils import clock

    state_dir_given, state_dir = state_dir is not None, state_dir or DEFAULT_STATE_DIR
    try:  # after the other checks: it may create the organiser key, or save the invitation
        access = resolve_access(run_id=run_id, state_dir=state_dir, state_dir_given=state_dir_given, private=private,
                                invite=invite, now=clock.now())
        spec = RunSpec.model_validate({**dict(spec), "run_id": access.run_id, "organiser": access.organiser})
    except AccessError as e:
        raise fail(str(e))
    except ValidationError:
        raise fail(run_id_problem(access.run_id) or "this invitation is damaged: copy it again, whole")
    from diloco_swarm.dht.swarm import SwarmError, parse_initial_peers  # lazy: hivemind

    try:
        peers = parse_initial_peers(initial_peers or [])
    except SwarmError as e:
        raise fail(str(e))
    config = NodeConfig(
        spec=spec,
        dataset=dataset,
        tokenizer=tokenizer,
        state_dir=state_dir,
        initial_peers=peers,
        host=host,
        port=port,
        announce=list(announce or []),
        client_mode=client_mode,
        public=public,
        batch_size=batch_size,
        inner_optimizer=inner_optimizer.value,
        device=device.value,
        threads=threads,
        max_outer_steps=max_outer_steps,
        target_group_size=target_group_size,
        max_group_size=max_group_size,
        matchmaking_time=matchmaking_time,
        averaging_window=averaging_window,
        allreduce_timeout=allreduce_timeout,
        max_upload_mbps=max_upload_mbps,
        max_download_mbps=max_download_mbps,
        metrics_file=metrics_file,
        max_dataset_bytes=max_dataset_bytes,
        name=name,
        wait_for_peers=wait_for_peers,
        eval_budget=eval_budget,
        active_hours=hours,
        invitation=access.invitation,
        private_files=access.saves,
        join_flags=_spec_flags_to_repeat(dataset=dataset, model=model, tokenizer=tokenizer, inner_steps=inner_steps, seq_len=seq_len,
                                         inner_lr=inner_lr, outer_lr=None if outer_lr == default_lr else outer_lr,
                                         outer_momentum=None if outer_momentum == default_momentum else outer_momentum,
                                         compression=compression.value, seed=seed, sync_mode=sync_mode.value,
                                         max_dataset_bytes=max_dataset_bytes if dataset is not None else None),
    )
    run_node(config)


def _spec_flags_to_repeat(**values) -> list[str]:
    """The run-spec flags (and, for a file dataset, --max-dataset-bytes) that differ from ``join``'s
    defaults: what another machine must pass to join this run, printed in the node's join line."""
    defaults = inspect.signature(join).parameters
    out: list[str] = []
    for name, value in values.items():
        default = defaults[name].default
        default = getattr(default, "value", default)  # enums
        if value is not None and value != default:
            out += [f"--{name.replace('_', '-')}", shlex.quote(str(value))]
    return out


def run_node(config) -> None:
    """Run a node; map every user-facing failure to one line and exit code 2 (3: a part of the node died)."""
    # lazy: the node (torch, hivemind)
    from diloco_swarm.averaging.codec import CodecError
    from diloco_swarm.data import DatasetError
    from diloco_swarm.dht.swarm import SwarmError
    from diloco_swarm.models.registry import ModelError
    from diloco_swarm.node.checkpoint import CheckpointError
    from diloco_swarm.node.inner import InnerOptimizerError
    from diloco_swarm.node.runner import Node, NodeError  # (tests/faults.py may put a faulty one there)
    from diloco_swarm.spec import SpecMismatch

    from diloco_swarm.dht.calls import ChildUnavailable
    from diloco_swarm.node.watchdog import EXIT_PART_LOST, PartLost

    code = 0
    try:
        Node(config).run()
    except (DatasetError, SwarmError, SpecMismatch, CheckpointError, NodeError, CodecError, ModelError,
            InnerOptimizerError) as e:
        code = fail(str(e)).exit_code
    except PartLost as e:  # the DHT, averager or p2pd died under the node (node/watchdog.py)
        code = fail(str(e), EXIT_PART_LOST).exit_code
    except ChildUnavailable as e:  # during start-up
        code = fail(f"{e}; the node stopped before training. Start it again", EXIT_PART_LOST).exit_code
    except MemoryError as e:  # numpy's and Python's allocation errors: the flags asked for more than this machine has
        why = str(e).split(" for an array")[0] or "out of memory"
        code = fail(f"{why}: lower --batch-size ({config.batch_size}), --seq-len ({config.spec.seq_len}) or the "
                    "model size").exit_code
    except OSError as e:
        code = fail(f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")).exit_code
    leave_now(code)


def leave_now(code: int) -> None:
    """End the process once the node has shut down, skipping interpreter finalization.

    A round abandoned at stop leaves its daemon thread inside torch; finalizing the
    interpreter under it aborts the process ("terminate called without an active exception", exit
    -6) after everything was saved. The node has already written its checkpoint and metrics and
    stopped its parts; a part that is somehow still alive is ended here, as multiprocessing's own
    exit hook would."""
    # lazy
    import multiprocessing as mp

    from diloco_swarm.utils.hivemind_fixes import remove_socket_dir

    for child in mp.active_children():
        child.terminate()
        child.join(timeout=2.0)
        if child.is_alive():
            child.kill()
    remove_socket_dir()  # os._exit skips atexit
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@app.command()
def demo(
    peers: Annotated[int, typer.Option(min=1, max=16, help="Number of local nodes to start.")] = 3,
    outer_steps: Annotated[int, typer.Option(min=1, help="Train until the swarm's outer step reaches this (--max-outer-steps of each node).")] = 5,
    inner_steps: Annotated[int, typer.Option(min=1, help="H: inner steps per outer step.")] = 50,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port of the first node on 127.0.0.1; 0 = any free port (the others always take free ports).")] = 31337,
    workdir: Annotated[Path, typer.Option(help="State dirs and metrics of the demo nodes go here.")] = Path("diloco-demo"),
    dataset: Annotated[Optional[str], typer.Option(help="Text file, folder or glob (default: Python's standard library).")] = None,
) -> None:
    """Start a local swarm of N real `diloco-node join` processes on 127.0.0.1 and watch them train."""
    require_node("demo")
    # lazy
    from diloco_swarm.cli.demo import run_demo
    from diloco_swarm.cli.precheck import InputError, check_dataset, check_port

    try:  # before the run folder is made: bad input leaves nothing behind
        check_port("127.0.0.1", port)
        check_dataset(dataset)
    except InputError as e:
        raise fail(str(e))
    try:
        code = run_demo(peers=peers, outer_steps=outer_steps, inner_steps=inner_steps, port=port, workdir=workdir,
                        dataset=dataset, console=err)
    except OSError as e:  # --workdir is a file, or not writable
        raise fail(f"--workdir {workdir}: {e.strerror or e}")
    raise typer.Exit(code)


@app.command()
def export(
    state_dir: Annotated[Path, typer.Option(help="State dir of a node that trained (holds checkpoint.pt).")] = Path("diloco-state"),
    out: Annotated[Path, typer.Option(help="New folder to write the Hugging Face model into (must not exist, or be empty).")] = Path("diloco-export"),
    metrics_file: Annotated[Optional[Path], typer.Option(help="The node's --metrics-file: every held-out loss it measured, for the model card's curve (default: STATE_DIR/metrics.jsonl, when it exists; the checkpoint keeps the curve too).")] = None,
) -> None:
    """Write θ_global of a node's checkpoint as a Hugging Face model folder (config.json, model.safetensors,
    and the run's tokenizer files; a byte-level run has none: token id = byte value) that
    transformers.AutoModelForCausalLM.from_pretrained(OUT) loads, and its model card (README.md: the run
    spec, tokens and outer steps, the held-out loss curve, and the contributors from the node's last view
    of the run's ledger)."""
    require_node("export")
    # lazy: torch
    from diloco_swarm.node.checkpoint import CheckpointError
    from diloco_swarm.node.export import ExportError, export_model

    try:
        info = export_model(state_dir, out, metrics_file=metrics_file)
    except (ExportError, CheckpointError) as e:
        raise fail(str(e))
    except OSError as e:
        raise fail(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "))
    err.print(f"exported {escape(printable(info['model']))} ({info['architecture']}) at outer step "
              f"{info['outer_step']} to {escape(printable(out))}: {', '.join(info['files'])}", soft_wrap=True)
    err.print(f"load it with: AutoModelForCausalLM.from_pretrained({escape(repr(str(out)))})", soft_wrap=True)


def _cli_exception_types() -> tuple[type[BaseException], ...]:
    """Usage/parameter errors of typer (which vendors click since 0.2x) and of click itself."""
    types: list[type[BaseException]] = [getattr(typer, "TyperException", None)]
    try:
        import click  # lazy, and optional: typer vendors its own

        types.append(click.ClickException)
    except ImportError:
        pass
    return tuple(t for t in types if t is not None)


def _abort_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [KeyboardInterrupt, getattr(typer, "Abort", None)]
    try:
        import click  # lazy, and optional: typer vendors its own

        types.append(click.Abort)
    except ImportError:
        pass
    return tuple(t for t in types if t is not None)


def _non_finite(opts: list[str], argv: list[str]) -> str | None:
    """``require_finite``'s line for a flag of ``opts`` given ``nan`` or ``inf`` in ``argv``, or None.
    A range check fails on nan first (nan ≤ 1 is false) and would say "should be less than or
    equal to 1" of a value that is no number at all."""
    for i, arg in enumerate(argv):
        for opt in opts:
            if arg == opt and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(opt + "="):
                value = arg[len(opt) + 1:]
            else:
                continue
            try:
                if not math.isfinite(float(value)):
                    return f"{opt} must be a finite number, got {value}"
            except ValueError:
                continue
    return None


def main() -> None:
    """Console-script entry point. ``kill -USR1 <pid>`` prints every thread's stack (for hangs)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # standalone_mode=False: usage errors come back to us, and each becomes one `error:` line
    # (click/typer would print a multi-line box that wraps the message).
    try:
        code = app(standalone_mode=False)
    except _cli_exception_types() as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `diloco-node`: show the help
            e.show()
        else:
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            fail(_non_finite(getattr(getattr(e, "param", None), "opts", None) or [], sys.argv[1:])
                 or f"{e.format_message()}{hint}")
        sys.exit(getattr(e, "exit_code", USAGE_ERROR))
    except _abort_types():
        err.print("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


# the commands that read a swarm (status, dashboard, probe) live in modules of their own
app.command()(status)
app.command()(dashboard)
app.command()(probe)
app.command()(invite_command)
app.command()(pause)
app.command()(resume)
