"""The declaration a config field that is a `trillm serve` flag carries (`Flag`), and the
argparse options and config arguments read off those declarations.

A flag is declared once, on the field it sets: `dataclasses.field(metadata=flag("--seed"))`
(a msgspec Struct's fields, which carry no metadata, in a table of `Flag`s next to it). The
command line (`trillm.cli._flags`) adds one argparse option per declaration, typed and
defaulted like its field, and builds the configs from the parsed values (`fields_from`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True)
class Flag:
    """A config field's `trillm serve` flag: its names (the long one first), help and choices.

    Its type is the field's (without None): a bool is a switch, `--x` (or `--x/--no-x` when it
    defaults to True). Its default is the field's, or `cli_default` where the server's differs
    or the field has none; None: the field's. `many`: the field is a tuple, given as one or
    more values, the flag repeatable (`--x a b --x c`); `parse` turns each string into an item.
    """

    names: tuple[str, ...]
    help: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    cli_default: Any = None
    hidden: bool = False  # a test hook: parsed, not in --help
    many: bool = False
    parse: Callable[[str], Any] | None = None

    @property
    def dest(self) -> str:
        """The parsed value's name, as argparse derives it: "--max-num-seqs": max_num_seqs."""
        return self.names[0].removeprefix("--").replace("-", "_")


def flag(
    *names: str,
    help: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    cli_default: Any = None,
    hidden: bool = False,
) -> dict[str, Flag]:
    """A dataclass field's metadata that makes it a flag: `field(metadata=flag("--seed"))`."""
    return {"flag": Flag(names, help, choices, metavar, cli_default, hidden)}


@dataclass(frozen=True)
class Option:
    """A declared flag with what its field says: the argparse option, and where it goes."""

    flag: Flag
    field: str  # the config field it sets
    kind: type  # int, float, str or bool: the field's type without None
    default: Any  # the parser's default


def options_of(config: type, table: Mapping[str, Flag] | None = None) -> list[Option]:
    """The flags of `config`'s fields: a dataclass's from their metadata, in field order, or
    those of `table` (field name -> `Flag`), for a msgspec Struct or a class declared elsewhere."""
    hints = typing.get_type_hints(config)
    if dataclasses.is_dataclass(config):
        fields: list[Any] = list(dataclasses.fields(config))
    else:
        fields = list(msgspec.structs.fields(config))
    defaults = {f.name: f.default for f in fields}
    if table is None:
        table = {f.name: f.metadata["flag"] for f in fields if "flag" in f.metadata}
    options = []
    for name, declared in table.items():
        default = declared.cli_default
        if default is None and defaults[name] not in (dataclasses.MISSING, msgspec.NODEFAULT):
            default = defaults[name]
        kind = str if declared.many else _scalar(hints[name])
        options.append(Option(declared, name, kind, default))
    return options


def fields_from(options: Iterable[Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """A config's keyword arguments from flag values by dest; a flag left out of `values`
    is left to its field's default."""
    return {
        o.field: tuple(values[o.flag.dest]) if o.flag.many else values[o.flag.dest]
        for o in options
        if o.flag.dest in values
    }


def _scalar(hint: Any) -> type:
    if isinstance(hint, types.UnionType):  # `int | None`: int
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint not in (int, float, str, bool):
        raise TypeError(f"a flag's field must be an int, float, str or bool, not {hint}")
    return typing.cast(type, hint)
