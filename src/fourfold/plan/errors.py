"""The one exception type of the planner."""

from __future__ import annotations

from fourfold.errors import FourfoldError


class PlanError(FourfoldError, ValueError):
    """A user mistake given to the planner (unknown model or machine, impossible batch, ...).

    Its message is one line meant for the user; the CLI prints it as `error: ...` and exits 2.
    """
