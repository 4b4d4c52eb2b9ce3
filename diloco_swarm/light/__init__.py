"""The light client: reads a swarm's signed records over py-libp2p, with no hivemind, torch or Go daemon.

``status``, ``dashboard`` and ``probe`` run on it (docs/light-client.md). Nothing here imports
hivemind or torch: importing both hivemind and libp2p in one process fails (both register
``crypto.pb.KeyType`` in protobuf's default pool).
"""
