"""The one exception type of the data pipeline."""

from __future__ import annotations

from fourfold.errors import FourfoldError


class DataError(FourfoldError, ValueError):
    """A user mistake about data (bad path, bad tokenizer spec, too little data).

    Its message is one line meant for the user; the CLI prints it as `error: ...` and exits 2.
    """
