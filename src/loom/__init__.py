"""loom: train Llama-style language models on one process or thousands.

`loom.fit(config)` trains from Python (docs/python-api.md)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["fit"]


def __getattr__(name: str) -> Any:
    """`loom.fit`, loaded on first use: `import loom` (the CLI's `--version`, `--help`, and
    its flag checks before any heavy import) stays free of torch. Not a cycle dodge:
    nothing under `loom.trainer` imports this package's namespace."""
    if name == "fit":
        from loom.trainer.entry import fit

        return fit
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
