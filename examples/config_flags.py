"""Command-line flags for the config dataclass of an example script, and the config they give.

Every flag defaults to None ("not given"), so that a config is built in three layers: the
dataclass defaults, then the --tiny overrides, then whatever flags were given.
"""
from __future__ import annotations

import argparse
import dataclasses


def add_field_flags(parser: argparse.ArgumentParser, defaults, fields: dict) -> None:
    """A flag --field-name per entry field_name: (kind, text) of `fields`, in that order, with
    help "text (default)". kind is a type (int, float) for a value, or a tuple of the allowed
    strings."""
    for name, (kind, text) in fields.items():
        values = dict(choices=kind) if isinstance(kind, tuple) else dict(type=kind)
        parser.add_argument("--" + name.replace("_", "-"), **values,
                            help=f"{text} ({getattr(defaults, name)})")


def add_tiny_flag(parser: argparse.ArgumentParser, text: str, tiny: dict) -> None:
    """--tiny, its help `text` followed by the overrides it applies."""
    parser.add_argument("--tiny", action="store_true",
                        help=text + ", ".join(f"{k}={v}" for k, v in tiny.items()))


def config_from_args(defaults, args: argparse.Namespace, tiny: dict):
    """A copy of the dataclass `defaults`, updated with `tiny` if args.tiny, then with every
    field whose flag was given (not None)."""
    values = dataclasses.asdict(defaults)
    if args.tiny:
        values.update(tiny)
    for field in values:
        given = getattr(args, field, None)
        if given is not None:
            values[field] = given
    return type(defaults)(**values)
