"""Benchmarks of diloco-swarm. They measure and print; nothing here asserts a time.

``python -m bench all`` runs :data:`NAMES` (``--quick``: toy sizes), ``python -m bench NAME`` or
``python -m bench.NAME`` one benchmark. Raw results go to ``bench/out/NAME.json``, and each benchmark's
section of ``docs/benchmarks.md`` (its figures, between markers) is regenerated from them.
"""

NAMES = ("wire", "codec", "round", "quality", "netns", "overlap", "speeds", "scale")
STANDALONE = ("churn", "idle", "simscale", "eager", "light", "staleness", "memory", "hostile", "sparse", "uplink")  # not in `all`: long or special
