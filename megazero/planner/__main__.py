"""``python -m megazero.planner``: see :mod:`megazero.planner.cli`."""

import sys

from megazero.planner.cli import main

sys.exit(main())
