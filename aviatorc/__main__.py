"""`python -m aviatorc` runs the command line."""

import sys

from aviatorc.cli import main

sys.exit(main())
