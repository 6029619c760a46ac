"""`python -m exp.bench`: see exp.bench.cli."""

import sys

from exp.bench.cli import main

sys.exit(main())
