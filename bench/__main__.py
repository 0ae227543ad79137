"""``python -m higgs_pack.targets.bench``: see :mod:`higgs_pack.targets.bench`."""

import sys

from higgs_pack.targets.bench import main

sys.exit(main())
