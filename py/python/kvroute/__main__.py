"""``python -m kvroute``: the ``kvroute`` command."""

import sys

from kvroute.cli import main

sys.exit(main())
