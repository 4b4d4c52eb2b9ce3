"""Errors that stop a node with one line (exit code 2)."""


class NodeError(Exception):
    """A user-facing problem that stops the node before or during training (exit code 2)."""


class Diverged(NodeError):
    """The local pseudo-gradient became non-finite: inner training diverged."""
