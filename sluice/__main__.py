"""``python -P -m sluice``: the same as the ``sluice`` command."""

import sys

from sluice.cli import main

sys.exit(main())
