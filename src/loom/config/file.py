"""`loom train --config run.toml` and `--print-config`: the job config as TOML, one table per
config dataclass (`[train] max_steps = 3`, `[optim] lr = 0.01`).

Read with the standard library's tomllib (its backport tomli on Python 3.10); written by the
small writer below (booleans, numbers, strings and the string lists of repeatable flags),
so what `--print-config` prints reads back equal.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loom.errors import ConfigError
from loom.safe_io import read_bytes_capped

MAX_CONFIG_BYTES = 1 << 20
"""The largest --config file read (every flag set is a few KB)."""


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _shown(value: Any) -> str:
    """A value for an error line, cut to 80 characters (a list can nest hundreds deep)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(section: str, f: dataclasses.Field, value: Any) -> Any:
    """The value if it has the field's type (an int is a valid float); else one line."""
    default, meta = _default(f), f.metadata
    if meta["repeat"]:  # a list of values (one value alone is taken as a list of one)
        items = value if isinstance(value, list) else [value]
        if not all(type(v) is meta["type"] for v in items):
            raise ConfigError(f"config file: [{section}] {f.name} = {_shown(value)} must be a list "
                              f"of {meta['type'].__name__}")
        return tuple(items)
    expected = type(default) if default is not None else meta["type"]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not expected:
        raise ConfigError(f"config file: [{section}] {f.name} = {_shown(value)} must be "
                          f"{expected.__name__}")
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"config file: [{section}] {f.name} = {_shown(value)}; choose from "
                          f"{', '.join(meta['choices'])}")
    return value


def read_config_file(path: str, sections: Mapping[str, list[dataclasses.Field]]
                     ) -> dict[str, Any]:
    """The file's settings as {field name: value}, every name and type checked against
    each section's flags (`loom.config.job.section_fields`: [model] holds the families')."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, installed as a dependency on Python 3.10
        import tomli as tomllib
    try:  # a FIFO or /dev/zero is refused at once, never read
        text = read_bytes_capped(Path(path).expanduser(), MAX_CONFIG_BYTES, follow=True)
        data = tomllib.loads(text.decode())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except RecursionError:  # tomllib descends once per nested array or inline table
        raise ConfigError(f"--config {path}: nests arrays or tables too deeply") from None
    except (OSError, ValueError, tomllib.TOMLDecodeError) as e:  # UnicodeDecodeError too
        raise ConfigError(f"--config {path}: {e}") from None
    values: dict[str, Any] = {}
    for section, table in data.items():
        if section not in sections or not isinstance(table, dict):
            raise ConfigError(f"--config {path}: unknown section [{section}]; sections: "
                              f"{', '.join(sections)}")
        known = {f.name: f for f in sections[section]}
        for name, value in table.items():
            if name not in known:
                raise ConfigError(f"--config {path}: [{section}] has no setting {name!r}")
            values[name] = _check(section, known[name], value)
    return values


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")) \
            if not math.isfinite(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, tuple):  # a repeatable flag's values: a TOML array
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a valid TOML basic string


def to_toml(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """One table per section ({section: {flag: value}}, in order); unset (None) fields are
    left out."""
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
