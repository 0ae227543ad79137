"""``python -m bench``: see :mod:`bench`."""

import sys

from bench import main

sys.exit(main())
