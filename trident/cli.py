"""The `trident` command: `trident serve [MODEL] [flags]` starts the server (`trident serve --help`)."""

from __future__ import annotations

import sys

USAGE = """usage: trident serve [MODEL] [flags]     start the OpenAI-compatible server (trident serve --help)
       trident --version"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from trident.launch import run_and_exit

        flags = argv[1:]
        if flags and not flags[0].startswith("-"):  # `vllm serve MODEL`'s form
            flags = ["--model", *flags]
        run_and_exit(flags)
    if argv[:1] == ["--version"]:
        from trident import __version__

        print(f"trident {__version__}")
        return 0
    print(USAGE, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2
