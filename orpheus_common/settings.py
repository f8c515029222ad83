"""Settings: one pydantic-settings model per command, read from flags over environment over defaults.

A field `max_batch` is flag `--max-batch` and variable `PREFIX_MAX_BATCH` (the model's env_prefix).
pydantic parses and checks every value: types, bounds and enums on the fields (`Field`, `Literal`),
rules between fields in model validators. A bad value stops start-up naming its flag, and the same
model's JSON schema gives the chart's values schema its types, bounds and enums (megapod/values_schema.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Self, TypeVar

from pydantic import BeforeValidator, ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

T = TypeVar("T")


def _split_commas(value: object) -> object:
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


# A tuple written as a comma list, in a flag or a variable alike: --frame-buckets 1,2,4 / SNAC_FRAME_BUCKETS=1,2,4.
CommaList = Annotated[tuple[T, ...], NoDecode, BeforeValidator(_split_commas)]


class Settings(BaseSettings):
    """The settings of one command. Only `from_cli` reads flags and the environment: a model built
    in code (`Model(field=...)`, a cluster profile, a test) is what the code says; `replace` derives
    a checked copy."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", validate_default=True, cli_kebab_case=True,
                                      cli_avoid_json=True, cli_implicit_flags=False, cli_exit_on_error=True,
                                      cli_show_env_vars=True,
                                      cli_parse_none_str="\x00none")  # never typed: `--tokenizer None` stays a string

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> Self:
        """Flags (`argv`, default sys.argv[1:]) over the environment (PREFIX_FIELD) over defaults; exit 2
        with the flag named when a value is wrong, as argparse does."""
        flags = CliSettingsSource(cls, cli_parse_args=list(sys.argv[1:] if argv is None else argv))()
        env = {name: environ[cls.env_name(name)] for name in cls.model_fields if cls.env_name(name) in environ}
        try:
            return cls.model_validate({**env, **flags})
        except ValidationError as exc:
            prog = cls.model_config.get("cli_prog_name") or cls.__name__
            named = {name: cls.env_name(name) for name in env.keys() - flags.keys()}  # the variable that set it
            print(f"usage: {prog} [-h] [--FIELD VALUE ...]\n{prog}: error: {explain(exc, named)}", file=sys.stderr)
            raise SystemExit(2) from None

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, checked like the original (dataclasses.replace, for settings)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    @classmethod
    def default(cls, field: str) -> Any:
        return cls.model_fields[field].default

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


def explain(exc: ValidationError, named: Mapping[str, str] | None = None) -> str:
    """Each error as `--flag: message` (or the variable's name, in `named`); a rule between fields as its message."""
    named = named or {}
    lines = []
    for error in exc.errors():
        if not error["loc"]:
            lines.append(error["msg"].removeprefix("Value error, "))
            continue
        field = str(error["loc"][0])
        lines.append(f"{named.get(field) or flag(field)}: {error['msg']}")
    return "; ".join(lines)


def flag(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def camel(field: str) -> str:
    """A field as the chart's values spell it: max_batch -> maxBatch."""
    first, *rest = field.split("_")
    return first + "".join(part.capitalize() for part in rest)


def as_flags(values: dict[str, object]) -> list[str]:
    """Field values as the flags that set them: what a launcher passes to a child."""
    return [text for name, value in values.items() for text in (flag(name), as_text(value))]


def as_text(value: object) -> str:
    """A value as a flag or variable writes it: true/false, a comma list, the number or string."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Iterable) and not isinstance(value, str):
        return ",".join(map(as_text, value))
    return str(value)
