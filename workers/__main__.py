import sys

from workers.cli import main

# Guarded: vLLM starts its engine processes with the spawn method, which imports this
# module again in each child.
if __name__ == "__main__":
    sys.exit(main())
