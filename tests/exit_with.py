"""``python -m tests.exit_with CODE``: a process that exits with CODE at once (a child for
the supervisor's tests)."""

import sys

if __name__ == "__main__":
    sys.exit(int(sys.argv[1]))
