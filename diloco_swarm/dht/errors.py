"""Errors of the swarm layer, importable without hivemind (the light client shares them)."""


class SwarmError(Exception):
    """A user-facing problem joining the swarm (bad address, busy port, no bootstrap peer)."""
