"""diloco-swarm: peer-to-peer DiLoCo training over hivemind."""
__version__ = "0.1.0"
