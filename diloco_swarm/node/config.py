"""Configuration of one node: the shared RunSpec plus local settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diloco_swarm.invites import Invitation
from diloco_swarm.node.pause import ActiveHours
from diloco_swarm.spec import RunSpec

IDENTITY_FILE = "identity.key"  # the node's libp2p key in its state dir (its peer id), written at its first start


@dataclass
class NodeConfig:
    """Everything ``diloco-node join`` needs. Times in seconds, sizes in tokens (bytes) or counts."""

    spec: RunSpec
    dataset: str | None = None  # None = the embedded Python standard library sources
    tokenizer: str | None = None  # --tokenizer; None = the model's default (node/assets.py)
    state_dir: Path = Path("diloco-state")
    initial_peers: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 0
    announce: list[str] = field(default_factory=list)
    client_mode: bool = False  # forced client; otherwise decided by the reachability check
    public: bool = False  # forced full peer: skip the reachability check
    batch_size: int = 16
    inner_optimizer: str = "adamw"  # node/inner.py: adamw | adamw8bit (local: its state never leaves the peer)
    device: str = "auto"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    max_outer_steps: int = 0  # 0 = train until stopped
    target_group_size: int = 0  # 0 = the whole swarm in one group, up to max_group_size
    max_group_size: int = 64
    matchmaking_time: float = 2.0  # a group leader gathers followers at least this long

    @property
    def group_size(self) -> int:
        """The most peers in one averaging group."""
        return min(self.target_group_size or self.max_group_size, self.max_group_size)
    averaging_window: float = 30.0  # wait at most this long for a group, then go solo
    allreduce_timeout: float = 60.0
    max_upload_mbps: float | None = None  # averaging/bandwidth.py: caps on this node's rounds and donations
    max_download_mbps: float | None = None
    metrics_file: Path | None = None
    eval_batches: int = 8
    max_dataset_bytes: int | None = None
    max_norm_ratio: float = 10.0
    wait_for_peers: int = 0  # before training, wait (at most wait_for_peers_timeout) until this many peers are up
    wait_for_peers_timeout: float = 120.0
    name: str = ""
    eval_budget: float = 0.02  # evaluate after a round only while evaluation has cost < this share of wall time
    join_flags: list[str] = field(default_factory=list)  # run-spec flags a joiner must repeat (shown in the join line)
    active_hours: ActiveHours | None = None  # --active-hours: train only inside this local-time window (node/pause.py)
    invitation: Invitation | None = None
    private_files: tuple = ()  # (path, text) pairs to save in the state dir once it is ours (cli/private.py)  # a private run: what admits us (cli/private.py); None in a public run
