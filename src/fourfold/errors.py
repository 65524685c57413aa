"""The one error type the `fourfold` command knows, its exit codes, and one-line messages.

Every error meant for the user derives from FourfoldError and carries its exit code, so the CLI
turns any of them into one `error: ...` line without knowing the classes. Each also keeps the
builtin base it always had (ValueError for a mistake, RuntimeError for a failure), so code that
catches those still does.
"""

from __future__ import annotations

from typing import ClassVar

EXIT_FAILED = 1  # a run that started and failed (NaN loss, a checkpoint that cannot be written)
EXIT_USAGE = 2  # the user asked for something impossible


class FourfoldError(Exception):
    """An error whose message is one line meant for the user; the CLI prints it as
    `error: ...` and exits with `exit_code` (EXIT_USAGE unless a subclass says otherwise)."""

    exit_code: ClassVar[int] = EXIT_USAGE


class UsageError(FourfoldError, ValueError):
    """A command line that does not parse (unknown option, bad choice, missing argument)."""


class ConfigError(FourfoldError, ValueError):
    """A user mistake in the configuration; its message is one line meant for the user."""


class ConfigNotice(FutureWarning):
    """A configuration that still works but is written the old way (a renamed key): one line
    that names the key to write instead."""


def first_line(error: BaseException | str) -> str:
    """The first non-blank line of an error's message, stripped: what a one-line report
    shows. An exception without a message gives its type's name, a blank string ''."""
    for line in str(error).splitlines():
        if line.strip():
            return line.strip()
    return type(error).__name__ if isinstance(error, BaseException) else ""
