"""The command line of `trident serve`, derived from the `Flag`s of `ServerArgs`' fields.

trident/wire/server_args.py defines each flag once, on its field; this module turns those
definitions into the argparse parser (one `--help` section per topic group), the field
values of a parsed command line, the command line of the offline `Engine`'s keyword
arguments, and docs/flags.md, the flag reference:

    python -m trident.flags                # print docs/flags.md
    python -m trident.flags --write-docs   # rewrite docs/flags.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from trident.foreign_flags import add_foreign_flags, foreign_flags_doc
from trident.wire.server_args import Derived, Flag, ServerArgs

FLAGS_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "flags.md")
"""The flag reference, generated whole from ServerArgs by `flags_doc()`."""

FLAGS_DOC_HEAD = """# Flags of `trident serve`

Generated from the `ServerArgs` fields in trident/wire/server_args.py by
`python -m trident.flags --write-docs`; edit the fields, not this file (tests/test_flags.py
fails while the two differ). The offline `Engine` takes the same flags as keyword arguments
named as the fields: `Engine(max_total_tokens=8192, disable_overlap=True)`.
"""


@dataclass(frozen=True)
class FlagField:
    """A ServerArgs field that is a flag: its name, Python type, default and `Flag`."""

    name: str
    type: type
    default: Any
    flag: Flag

    @property
    def names(self) -> tuple[str, ...]:
        if self.flag.switches:
            return tuple(self.flag.switches)
        return self.flag.names or ("--" + self.name.replace("_", "-"),)

    @property
    def json_kind(self) -> type | None:
        """dict or list for a field whose flag takes JSON (`--override-generation-config '{...}'`,
        `--allowed-origins '["*"]'`, as vLLM's do), else None."""
        kind = typing.get_origin(self.type) or self.type
        return kind if kind in (dict, list) else None

    @property
    def cli_default(self) -> Any:
        """The parser's default: unset where launch fills the value in, else the field's."""
        if self.flag.default_text is not None:
            return None
        if self.flag.env is not None:
            return os.environ.get(self.flag.env, self.default)
        return self.default


def _split_annotation(annotation: Any) -> tuple[type, tuple[Any, ...]]:
    """(the value type without None, the Annotated metadata) of a field's annotation."""
    extras: tuple[Any, ...] = ()
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *rest = typing.get_args(annotation)
        extras = tuple(rest)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation, extras


def flag_fields() -> list[FlagField]:
    """Every flag field of ServerArgs, in field order."""
    out = []
    for field in msgspec.structs.fields(ServerArgs):
        value_type, extras = _split_annotation(field.type)
        flags = [e for e in extras if isinstance(e, Flag)]
        if flags:
            if field.default_factory is not msgspec.NODEFAULT:
                default = field.default_factory()
            else:
                default = None if field.default is msgspec.NODEFAULT else field.default
            out.append(FlagField(field.name, value_type, default, flags[0]))
    return out


def derived_fields() -> dict[str, Derived]:
    """The fields launch computes rather than parses, with where each comes from."""
    out = {}
    for field in msgspec.structs.fields(ServerArgs):
        for extra in _split_annotation(field.type)[1]:
            if isinstance(extra, Derived):
                out[field.name] = extra
    return out


def _groups(fields: list[FlagField]) -> Iterator[tuple[str, list[FlagField]]]:
    """The topic groups in order of their first field."""
    order: dict[str, list[FlagField]] = {}
    for f in fields:
        order.setdefault(f.flag.group, []).append(f)
    yield from order.items()


def _add_argument(group: argparse._ArgumentGroup, f: FlagField) -> None:
    help_text = f"{f.flag.help} (default: {_default_text(f)})".replace("%", "%%")
    if f.flag.env is not None:
        help_text += f" (env {f.flag.env})"
    if f.flag.switches:
        exclusive = group.add_mutually_exclusive_group()
        for name, const in f.flag.switches.items():
            exclusive.add_argument(
                name,
                dest=f.name,
                action="store_const",
                const=const,
                default=f.default,
                help=help_text if name == f.names[0] else f"see {f.names[0]}",
            )
        return
    if f.type is bool:
        action = "store_false" if f.default else "store_true"
        group.add_argument(*f.names, dest=f.name, action=action, help=help_text)
        return
    group.add_argument(
        *f.names,
        dest=f.name,
        type=json_parser(f.json_kind) if f.json_kind else f.type,
        nargs="+" if f.flag.several else None,
        default=f.cli_default,
        choices=f.flag.choices,
        metavar=f.flag.metavar or (None if f.flag.choices else f.names[0].lstrip("-").replace("-", "_").upper()),
        help=help_text,
    )


def json_parser(kind: type) -> Callable[[str], Any]:
    """The argparse type of a flag that takes a JSON object (dict) or a list of strings."""

    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if kind is dict and not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
        if kind is list and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value

    parse.__name__ = f"JSON {kind.__name__}"  # argparse names the type in its error
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trident serve",
        description="trident: an OpenAI-compatible LLM server (tokenizer, scheduler, workers).",
    )
    for title, fields in _groups(flag_fields()):
        group = parser.add_argument_group(title)
        for f in fields:
            _add_argument(group, f)
    add_foreign_flags(parser)
    return parser


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The ServerArgs field values of a parsed command line, before launch resolves any."""
    return {f.name: getattr(ns, f.name) for f in flag_fields()}


def argv_of(values: Mapping[str, Any]) -> list[str]:
    """The command line that parses to these field values (`max_total_tokens=8` -> `--max-total-tokens 8`).

    Raises TypeError for a name that is not a flag field.
    """
    by_name = {f.name: f for f in flag_fields()}
    argv: list[str] = []
    for name, value in values.items():
        f = by_name.get(name)
        if f is None:
            raise TypeError(f"unknown server flag {name!r}")
        if f.flag.switches:
            # The first switch that sets it: others may be another engine's spelling of the same.
            argv += [n for n, const in f.flag.switches.items() if const == value and value != f.default][:1]
            if value != f.default and value not in f.flag.switches.values():
                raise ValueError(f"{name}={value!r}: expected one of {f.flag.choices}")
        elif f.type is bool:
            if bool(value) != f.default:
                argv.append(f.names[0])
        elif isinstance(value, list | tuple) and f.flag.several:
            argv += [f.names[0], *map(str, value)]
        elif value is not None and f.json_kind:
            argv += [f.names[0], json.dumps(value)]
        elif value is not None:
            argv += [f.names[0], str(value)]
    return argv


def _flag_cell(f: FlagField) -> str:
    names = " / ".join(f"`{n}`" for n in f.names)
    if f.flag.choices and not f.flag.switches:
        names += " " + "\\|".join(f.flag.choices)
    elif f.flag.metavar:
        names += " " + f.flag.metavar.replace("|", "\\|")
    return names


def _default_text(f: FlagField) -> str:
    if f.flag.default_text is not None:
        return f.flag.default_text
    if f.type is bool:
        return "off"
    if f.json_kind and f.default is not None:
        return json.dumps(f.default)
    return "none" if f.default is None else str(f.default)


def flags_doc() -> str:
    """docs/flags.md: one section per group, one table row per flag."""
    lines = [FLAGS_DOC_HEAD]
    for title, fields in _groups(flag_fields()):
        lines += [f"## {title}", "", "| flag | meaning | default |", "|---|---|---|"]
        for f in fields:
            env = f" (env `{f.flag.env}`)" if f.flag.env else ""
            help_text = f.flag.help.replace("|", "\\|")
            lines.append(f"| {_flag_cell(f)} | {help_text}{env} | {_default_text(f)} |")
        lines.append("")
    lines += foreign_flags_doc()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write-docs"]:
        with open(FLAGS_DOC, "w") as fh:
            fh.write(flags_doc())
        return 0
    print(flags_doc(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
