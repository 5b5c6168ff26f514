"""`python launch.py [flags]` from a checkout: the same server as `trident serve [flags]`."""

import sys

from trident.launch import main

if __name__ == "__main__":
    sys.exit(main())
