"""Settings from flags over environment variables over defaults, onto a frozen dataclass.

A field `max_batch` is flag `--max-batch` and variable `PREFIX_MAX_BATCH`; its type says how the text
parses (bool, int, float, str, tuple of those as a comma list). The dataclass's __post_init__ checks
the values, so a bad one stops start-up with the flag named.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Collection, Mapping, Sequence


def parse_value(kind: object, text: str) -> object:
    """One flag or env value as the field type `kind`."""
    if kind is bool:
        if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("1", "true", "yes", "on")
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return tuple(item(x.strip()) for x in text.split(",") if x.strip())
    return kind(text)  # type: ignore[operator]


def add_field_flags(
    parser: argparse._ActionsContainer, cls: type, help: Callable[[dataclasses.Field], str],
    only: Collection[str] | None = None,
) -> None:
    """A `--field-name` flag for each field of dataclass `cls` (or those in `only`), read by field_values.

    The servers, `megapod up` and `megapod deploy` all take their flags from here, so a field's
    flag, and how its text becomes a value, is the same in every command."""
    for f in dataclasses.fields(cls):
        if only is None or f.name in only:
            parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                                metavar=f.name.upper(), help=help(f))


def field_values(cls: type, args: argparse.Namespace, env: Mapping[str, str] | None = None, prefix: str = "") -> dict:
    """The fields given as flags (add_field_flags), else as PREFIX_FIELD_NAME in `env`, each parsed
    as its type; ValueError names the flag of a value that does not parse."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        text = getattr(args, f.name, None)
        if text is None and env is not None:
            text = env.get(f"{prefix}{f.name.upper()}")
        if text is not None:
            try:
                values[f.name] = parse_value(hints[f.name], text)
            except ValueError as exc:
                raise ValueError(f"--{f.name.replace('_', '-')}: {exc}") from None
    return values


def config_from_args(cls: type, argv: Sequence[str] | None, env: Mapping[str, str], prefix: str, prog: str):
    """Build dataclass `cls` from flags (`--field-name`) over env (`PREFIX_FIELD_NAME`) over defaults."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_field_flags(parser, cls, lambda f: f"(env {prefix}{f.name.upper()}; default {f.default!r})")
    args = parser.parse_args(argv)
    try:
        return cls(**field_values(cls, args, env, prefix))
    except ValueError as exc:
        parser.error(str(exc))
