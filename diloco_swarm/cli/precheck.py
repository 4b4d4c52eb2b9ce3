"""Checks of ``join``'s input that need neither torch nor hivemind, run before those imports (5–60 s).

Each check runs ahead of a slower, authoritative one that still runs later (``dht/swarm.py``'s
multiaddr parsing and port check, ``data/corpus.py``'s dataset loading) and reports the same
message, so bad input is refused at once: the port and dataset checks call the very functions
the node uses; the multiaddr check lets what it cannot decide cheaply through to the slow one,
so it never refuses an address the node would accept.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diloco_swarm.data.files import DatasetError, list_dataset_files
from diloco_swarm.data.hf_source import hf_dataset_problem, is_hf_dataset
from diloco_swarm.data.tokenizer import tokenizer_problem
from diloco_swarm.models.registry import model_problem
from diloco_swarm.utils.net import host_problem, multiaddr_problem, port_problem


class InputError(ValueError):
    """Bad command-line input; the message is one line."""


def is_malformed_multiaddr(addr: str) -> bool:
    """True when hivemind's multiaddr parser would certainly refuse ``addr``."""
    return multiaddr_problem(addr, unknown=False) is not None


def check_initial_peers(values: Sequence[str]) -> None:
    """Refuse an empty address (which would silently start a new swarm) and obviously malformed ones.

    :raises InputError: same messages as ``dht.swarm.parse_initial_peers``.
    """
    for value in values:
        items = value.replace(",", " ").split()
        if not items:
            raise InputError(f"--initial-peers: got an empty address ({value!r}); give the multiaddr a node prints "
                             "(/ip4/HOST/tcp/PORT/p2p/PEER_ID), or omit --initial-peers to start a new swarm")
        for item in items:
            problem = multiaddr_problem(item, unknown=False)
            if problem is not None:
                raise InputError(f"--initial-peers: '{item}' {problem} (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID)")
            if "/p2p/" not in item:
                unknown = multiaddr_problem(item)  # a protocol we do not know (hivemind may: it decides with /p2p/)
                if unknown is not None:
                    raise InputError(f"--initial-peers: '{item}' {unknown}; copy the full address a node prints "
                                     "(/ip4/HOST/tcp/PORT/p2p/PEER_ID)")
                raise InputError(f"--initial-peers: '{item}' lacks the /p2p/PEER_ID part; copy the full address a node prints")


def check_announce(values: Sequence[str]) -> None:
    """:raises InputError: same message as ``dht.swarm.start_dht``."""
    for a in values:
        problem = multiaddr_problem(a, unknown=False)
        if problem is not None:
            raise InputError(f"--announce: '{a}' {problem} (expected /ip4/PUBLIC_IP/tcp/PORT)")
        if "/p2p/" in a:  # the node appends its own peer id; a second one makes an address nobody can dial
            raise InputError(f"--announce: '{a}' has a /p2p/ part; give only /ip4/PUBLIC_IP/tcp/PORT "
                             "(the node adds its own peer id)")


def check_port(host: str, port: int) -> None:
    """:raises InputError: the port is busy or the address is not local (``utils.net.port_problem``)."""
    problem = port_problem(host, port)
    if problem is not None:
        raise InputError(problem)


def check_dataset(dataset: str | None) -> None:
    """:raises InputError: the ``DatasetError`` that loading would raise for a missing path, an empty
    folder or a glob without matches (it stops at the first file, and reads none)."""
    if dataset is None:
        return
    if is_hf_dataset(dataset):
        problem = hf_dataset_problem(dataset)
        if problem:
            raise InputError(problem)
        return

    try:
        list_dataset_files(dataset, first_only=True)
    except DatasetError as e:
        raise InputError(str(e)) from None


def check_model_and_tokenizer(model: str, tokenizer: str | None) -> None:
    """:raises InputError: an unknown ``--model``, a missing path, or a Hub id while offline (same
    messages as ``models.registry.resolve_model`` and ``data.tokenizer.load_tokenizer``)."""
    problem = model_problem(model) or (tokenizer_problem(tokenizer) if tokenizer else None)
    if problem:
        raise InputError(problem)


def check_metrics_file(metrics_file: Path | None) -> None:
    """:raises InputError: ``--metrics-file`` is a folder (same message as ``node.runner.Node``)."""
    if metrics_file is not None and metrics_file.is_dir():
        raise InputError(f"--metrics-file {metrics_file}: is a directory")


def check_join_input(*, initial_peers: Sequence[str], announce: Sequence[str], host: str, port: int,
                     dataset: str | None, model: str = "tiny", tokenizer: str | None = None,
                     metrics_file: Path | None = None) -> None:
    """All of the above, in the order the node itself would find the problems. :raises InputError:"""
    check_metrics_file(metrics_file)
    check_initial_peers(initial_peers)
    check_model_and_tokenizer(model, tokenizer)
    check_dataset(dataset)
    if host_problem(host):
        raise InputError(host_problem(host))
    check_port(host, port)
    check_announce(announce)
