"""``python -m blockq.frontdoors.gateway --host 127.0.0.1 --port 8000``."""

import sys

from blockq.frontdoors.gateway.cli import main

sys.exit(main())
