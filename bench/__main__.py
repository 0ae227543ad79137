"""``python -m bench``: :func:`bench.decoder.run.main`."""

import sys

from bench.decoder.run import main

sys.exit(main())
