"""`python -m trident serve [flags]`: the same as the `trident` command."""

import sys

from trident.cli import main

sys.exit(main())
