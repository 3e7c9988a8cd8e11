"""`python -m stepgrpo_cli ...`: the console script."""

import sys

from stepgrpo_cli.app import app

sys.exit(app())
