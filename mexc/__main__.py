"""`python -m mexc ...` runs the command line (mexc.cli.main)."""

import sys

from mexc.cli import main

sys.exit(main())
