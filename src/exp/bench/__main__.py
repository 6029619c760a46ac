"""`python -m exp.bench` (exp.bench.cli), and each variant's worker process (`worker=<spec>`)."""

import sys

from exp.bench.cli import main

sys.exit(main())
