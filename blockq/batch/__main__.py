"""``python -m blockq.batch worker`` (or submit / status / cancel)."""

import sys

from blockq.batch.cli import main

sys.exit(main())
