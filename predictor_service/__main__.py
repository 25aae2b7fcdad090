import sys

from predictor_service.stage import main

sys.exit(main())
