"""The configuration a Python caller hands `loom.fit`: a JobConfig, validated here since no
parser checked its values, or `loom train`'s flags as a list of strings, parsed."""

from __future__ import annotations

from collections.abc import Sequence

from loom.config.job import JobConfig
from loom.config.parser import parse_args
from loom.config.validate import validate
from loom.errors import ConfigError


def fit_config(config: JobConfig | Sequence[str]) -> JobConfig:
    """A JobConfig as given (validated: built in Python, no parser has checked its values),
    or parsed from `loom train` flags (a list of strings); anything else is a ConfigError."""
    if isinstance(config, JobConfig):
        validate(config)
        return config
    if isinstance(config, (str, bytes)):
        raise ConfigError("loom.fit takes a JobConfig or a list of `loom train` flags, not "
                          "one string (split it, e.g. with shlex.split)")
    if not isinstance(config, (list, tuple)):
        raise ConfigError(f"loom.fit takes a JobConfig or a list of `loom train` flags, not "
                          f"{type(config).__name__}")
    wrong = next((a for a in config if not isinstance(a, str)), None)
    if wrong is not None:
        raise ConfigError(f"loom.fit: the flags must be strings, got {type(wrong).__name__} "
                          f"{wrong!r:.60}")
    argv = list(config)
    asked = sorted({"-h", "--help", "--print-config"} & set(argv))
    if asked:
        raise ConfigError(f"loom.fit: {', '.join(asked)} are `loom train`'s, on the command line")
    return parse_args(argv)
