"""Benchmarks of diloco-swarm: wire bytes, codec, averaging rounds, training quality, slow links,
overlapped vs blocking rounds, mixed peer speeds, group sizes and θ_global lineages of an 8-peer swarm;
standalone ones (``python -m bench.NAME``): churn, idle, simscale, eager, staleness, light and memory.

Run ``python -m bench all`` (or ``python -m bench NAME``; ``--quick`` for toy sizes). Raw
results go to ``bench/out/NAME.json``; ``docs/benchmarks.md`` and the ``docs/bench-*.png``
plots are regenerated from them. Benchmarks are never tests: nothing here asserts a time.
"""

NAMES = ("wire", "codec", "round", "quality", "netns", "overlap", "speeds", "scale")
