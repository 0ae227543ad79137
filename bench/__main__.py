"""``python -m bench``: :func:`bench.cli.main`."""

import sys

from bench.cli import main

sys.exit(main())
