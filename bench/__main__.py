"""``python -m bench``: :func:`bench.run.main`."""

import sys

from bench.run import main

sys.exit(main())
