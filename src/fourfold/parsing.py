"""The argument parser every fourfold command uses."""

from __future__ import annotations

import argparse
from typing import NoReturn

from fourfold.errors import FourfoldError, UsageError


class ArgumentParser(argparse.ArgumentParser):
    """argparse without prefix matching (`--nproc` must not also answer to `--np`) whose usage
    mistakes raise `usage_error` (UsageError unless a command has its own, as the planner's
    PlanError) instead of exiting, so the CLI owns the exit code (2) and prints the one
    `error: ...` line every other mistake gets."""

    def __init__(self, prog: str | None = None, description: str | None = None,
                 add_help: bool = True,
                 usage_error: type[FourfoldError] = UsageError) -> None:
        super().__init__(prog=prog, description=description, add_help=add_help,
                         allow_abbrev=False)
        self.usage_error = usage_error

    def error(self, message: str) -> NoReturn:
        raise self.usage_error(f"{message} (see `{self.prog} --help`)")
