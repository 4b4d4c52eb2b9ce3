"""The ``diloco-node`` command line (typer)."""

from diloco_swarm.cli.app import app, main

__all__ = ["app", "main"]
