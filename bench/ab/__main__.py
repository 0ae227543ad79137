"""``python -m bench.ab``: :func:`bench.ab.settings.main`."""

import sys

from bench.ab.settings import main

sys.exit(main())
