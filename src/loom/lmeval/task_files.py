"""The task configs of an --eval-tasks-include folder, read before the harness sees them.

The harness loads a task YAML with a loader that imports Python: `!function utils.fn`
runs `utils.py` from beside the YAML, `class:` names a Python task, an `include:` pulls in
another YAML (anywhere) that may do either, and `dataset_kwargs: {trust_remote_code: true}`
runs a dataset's loading script. A folder someone else wrote is code, then, and runs only
with --trust-remote-code, as a tokenizer's does. Each file the harness would open (every
`*.yaml` below the folder and what they include) is read here first: a regular file of at
most MAX_TASK_YAML_BYTES (a FIFO would hang the harness's open), parsed with a safe loader
that records every tag instead of acting on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loom.errors import ConfigError
from loom.safe_io import read_bytes_capped

MAX_TASK_YAML_BYTES = 1 << 20
"""The largest task YAML read (the harness's own are a few KB)."""
MAX_TASK_FILES = 5_000
"""Most YAML files looked at in one folder and its includes (the harness ships ~15,000 in
its own tree; a user's folder holds a few)."""
FLAG = "--eval-tasks-include"


class TagRecorder(yaml.SafeLoader):
    """A safe loader that constructs every unknown tag (`!function`, `!!python/...`) as
    None and remembers its name: nothing is imported."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.tags: list[str] = []


def _record(loader: TagRecorder, suffix: str, node: yaml.Node) -> None:
    loader.tags.append(node.tag)


TagRecorder.add_multi_constructor("", _record)


def parse(path: Path) -> tuple[Any, list[str]]:
    """(the YAML's data, the tags it names); a file the harness could not parse either is
    (None, []): the harness skips it."""
    try:
        text = read_bytes_capped(path, MAX_TASK_YAML_BYTES, follow=True)
    except FileNotFoundError:
        return None, []  # a dangling link: the harness skips it too
    except (OSError, ValueError) as e:
        raise ConfigError(f"{FLAG}: {path}: {e}") from None
    loader = TagRecorder(text)
    try:
        return loader.get_single_data(), loader.tags
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError):
        return None, []
    finally:
        loader.dispose()


def code_it_names(data: Any, tags: list[str]) -> str | None:
    """What in one parsed task YAML would run Python, or None."""
    if tags:
        return f"the tag {tags[0]}"
    if not isinstance(data, dict):
        return None
    if "class" in data:
        return "a Python task class (class:)"
    kwargs = data.get("dataset_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("trust_remote_code"):
        return "a dataset loading script (dataset_kwargs: trust_remote_code)"
    return None


def includes(data: Any, path: Path) -> list[Path]:
    """The files an `include:` names, resolved as the harness resolves them."""
    if not isinstance(data, dict) or "include" not in data:
        return []
    named = data["include"] if isinstance(data["include"], list) else [data["include"]]
    return [Path(n) if Path(str(n)).is_absolute() else path.parent / str(n) for n in named]


def check_task_folder(include: str, trust_remote_code: bool) -> None:
    """One line if a task YAML under `include` (or one it includes) is not a bounded
    regular file, or names Python without `trust_remote_code`."""
    root = Path(include).expanduser()
    if root.is_dir():
        pending = sorted(p for p in root.glob("**/*.yaml") if "__pycache__" not in p.parts)
    else:
        pending = [root]  # a FIFO or a device is refused by the read below
    seen: set[Path] = set()
    while pending:
        path = pending.pop()
        key = path.resolve()
        if key in seen:
            continue
        seen.add(key)
        if len(seen) > MAX_TASK_FILES:
            raise ConfigError(f"{FLAG} {include}: more than {MAX_TASK_FILES:,} task YAML files")
        data, tags = parse(path)
        code = code_it_names(data, tags)
        if code is not None and not trust_remote_code:
            raise ConfigError(f"{FLAG} {include}: {path} names Python ({code}); the harness "
                              "would run it: pass --trust-remote-code if you trust this folder")
        pending.extend(includes(data, path))
