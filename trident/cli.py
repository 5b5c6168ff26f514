"""The `trident` command: `trident serve [MODEL] [flags]` starts the server (`trident serve --help`);
`trident run-batch` serves a batch file offline (trident/run_batch.py)."""

from __future__ import annotations

import sys

USAGE = """usage: trident serve [MODEL] [flags]     start the OpenAI-compatible server (trident serve --help)
       trident run-batch -i IN.jsonl -o OUT.jsonl [flags]     OpenAI's batch format, offline
       trident --version"""


def model_first(flags: list[str]) -> list[str]:
    """Server flags that may begin with the model, as `vllm serve MODEL` takes it."""
    return ["--model", *flags] if flags and not flags[0].startswith("-") else flags


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from trident.launch import run_and_exit

        run_and_exit(model_first(argv[1:]))
    if argv[:1] == ["run-batch"]:
        from trident.run_batch import main as run_batch

        return run_batch(argv[1:])
    if argv[:1] == ["--version"]:
        from trident import __version__

        print(f"trident {__version__}")
        return 0
    print(USAGE, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2
