"""`python launch.py [flags]` from a checkout: the same server as `trident serve [flags]`."""

from trident.launch import run_and_exit

if __name__ == "__main__":
    run_and_exit()
