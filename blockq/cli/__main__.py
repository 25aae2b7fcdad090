import sys

from blockq.cli.main import main

sys.exit(main())
