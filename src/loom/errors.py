"""Every error a loom command turns into an exit code, and those codes, in one place.

A user's input, a diverged run and a stop request are different events for a scheduler or
a retry script, so each has its own code (docs/troubleshooting.md: Exit codes).
"""

from __future__ import annotations

import signal

FAILURE_EXIT = 1
"""A rank-specific runtime failure (a crash, a lost peer, a failed checkpoint write)."""
BAD_INPUT_EXIT = 2
"""A configuration error: the same on every rank, printed by rank 0 if it got there."""
DIVERGED_EXIT = 3
"""The flags were valid but training diverged (a non-finite loss or gradient)."""
SIGTERM_EXIT = 128 + signal.SIGTERM
"""143: stopped by SIGTERM (a scheduler's preemption), the shell's 128 + signal number."""
SIGINT_EXIT = 128 + signal.SIGINT
"""130: stopped by Ctrl-C."""


class ConfigError(ValueError):
    """A setting the user can change is invalid; reported as one line on every rank."""


class NonFiniteLossError(Exception):
    """Identical on every rank (the loss is all-reduced), so reported once, by rank 0. Not a
    ConfigError: a diverged run is not bad input."""


class Preempted(Exception):
    """SIGTERM or SIGINT arrived: the run stopped after the current step, with a final
    checkpoint when one could be made; exits 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class DeviceOutOfMemory(Exception):
    """The device ran out of memory; the message names the allocator snapshot written for
    it. Rank-specific (one rank may run out first): that rank reports it in one line."""


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank (disk full, permissions); the same line on every rank."""


class LaunchError(Exception):
    """`loom launch`: a launch that cannot be built from the options and environment given."""
