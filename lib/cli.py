"""The `trillm` command line: one parser, subcommands added as their issues land."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    """The `trillm` argument parser."""
    parser = argparse.ArgumentParser(
        prog="trillm",
        description="trillm: an LLM inference server on trio and shared-memory rings.",
    )
    parser.add_argument("--version", action="version", version=f"trillm {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trillm` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits


if __name__ == "__main__":
    sys.exit(main())
