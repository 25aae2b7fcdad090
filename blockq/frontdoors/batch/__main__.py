"""``python -m blockq.frontdoors.batch worker`` (or submit / status / cancel)."""

import sys

from blockq.frontdoors.batch.cli import main

sys.exit(main())
