"""``python -m diloco_swarm`` = ``diloco-node``."""

from diloco_swarm.cli import main

if __name__ == "__main__":
    main()
