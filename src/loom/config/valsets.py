"""The validation sets a job names: each `--val-dataset` value is `PATH` (the default set,
logged as `val/loss`) or `NAME=PATH` (logged as `val/NAME/loss`). Parsed here, once, for
the checks (`loom.config.validate`) and the data (`loom.data.loaders`) alike."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from loom.config.schema import EvalConfig
from loom.errors import ConfigError

DEFAULT_SET = ""
"""The unnamed set's name: `--val-dataset PATH` or `--val-fraction`; its keys are `val/*`."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A set's name: one metric-key segment (no `/`, no `=`), so `val/NAME/loss` parses back."""


def split_val_dataset(value: str) -> tuple[str, str]:
    """(name, path) of one --val-dataset value. The part before the first `=` names the set
    when it is a valid name; a path whose own text has an `=` (a folder `a=b/`) is taken
    whole unless it is written `NAME=PATH`."""
    name, sep, path = value.partition("=")
    if sep and NAME.fullmatch(name):
        if not path.strip():
            raise ConfigError(f"--val-dataset {value!r}: no path after '{name}='")
        return name, path
    if not value.strip():
        raise ConfigError("--val-dataset must not be empty")
    return DEFAULT_SET, value


def val_sets(e: EvalConfig) -> dict[str, str]:
    """{name: path} of the --val-dataset values in order (the default set as ""); a name
    given twice, or two unnamed sets, is an error."""
    sets: dict[str, str] = {}
    for value in e.val_dataset:
        name, path = split_val_dataset(value)
        if name in sets:
            what = f"the name {name!r}" if name else "no name (the default set)"
            raise ConfigError(f"--val-dataset: two sets with {what}; name each NAME=PATH")
        sets[name] = path
    return sets


def val_prefix(name: str) -> str:
    """The metric keys' prefix of a validation set: `val/` or `val/NAME/`."""
    return f"val/{name}/" if name else "val/"


@contextmanager
def naming_val_dataset() -> Iterator[None]:
    """A validation set's errors name --val-dataset: the readers it goes through name
    --dataset, the flag of the data they usually read."""
    try:
        yield
    except ConfigError as e:
        text = str(e)
        if text.startswith("--dataset "):
            raise ConfigError("--val-dataset " + text.removeprefix("--dataset ")) from None
        raise
