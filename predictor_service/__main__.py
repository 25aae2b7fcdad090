import sys

from predictor_service.serve import main

sys.exit(main())
