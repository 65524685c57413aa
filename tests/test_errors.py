"""One error type the CLI knows: every user-facing error is a FourfoldError with its exit code."""

from __future__ import annotations

import pytest

from fourfold import cli
from fourfold.config import ConfigError
from fourfold.data.errors import DataError
from fourfold.errors import EXIT_FAILED, EXIT_USAGE, FourfoldError, UsageError, first_line
from fourfold.eval.memorization import MemorizationAuditError
from fourfold.parallel.grid import GridError
from fourfold.plan.errors import PlanError
from fourfold.report import ReportError
from fourfold.models.hf import InitFromError
from fourfold.train.checkpoint import CheckpointError
from fourfold.train.runs import RunDirError
from fourfold.train.trainer import TrainingError

MISTAKES = (ConfigError, DataError, GridError, PlanError, MemorizationAuditError, ReportError,
            RunDirError, InitFromError, UsageError)
FAILURES = (TrainingError, CheckpointError)


def test_every_user_error_is_a_fourfold_error_with_its_exit_code() -> None:
    for cls in MISTAKES:
        assert issubclass(cls, FourfoldError) and issubclass(cls, ValueError), cls
        assert cls.exit_code == EXIT_USAGE == 2, cls
    for cls in FAILURES:
        assert issubclass(cls, FourfoldError) and issubclass(cls, RuntimeError), cls
        assert cls.exit_code == EXIT_FAILED == 1, cls


@pytest.mark.parametrize("error,code", [
    (ConfigError("train.steps = -1: must be positive\nmore detail"), 2),
    (PlanError("unknown machine 'x'"), 2),
    (TrainingError("loss is NaN at step 3", 3), 1),
    (CheckpointError("cannot read checkpoint runs/a: truncated"), 1),
    (FileNotFoundError(2, "No such file or directory", "missing.toml"), 2),
])
def test_the_cli_prints_one_line_and_exits_with_the_errors_code(
        error: BaseException, code: int, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(argv: list[str], signals: cli.StopSignals) -> int:
        raise error

    monkeypatch.setattr(cli, "_dispatch", fail)
    assert cli.main(["train"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "more detail" not in err


def test_an_unexpected_error_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(argv: list[str], signals: cli.StopSignals) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_dispatch", fail)
    with pytest.raises(KeyError):
        cli.main(["train"])


def test_first_line() -> None:
    assert first_line(ValueError("\n  first  \nsecond")) == "first"
    assert first_line(RuntimeError()) == "RuntimeError"
    assert first_line("  \n") == ""
    assert first_line("one\ntwo") == "one"
