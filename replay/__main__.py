"""``python -P -m sluice.replay FILE…``."""

import sys

from sluice.replay.cli import main

sys.exit(main())
