"""The `fourfold` command: train, prepare, generate, eval, plan, report, convert.

Each subcommand imports what it needs when it runs, so `fourfold --help` is quick and one
missing optional piece does not break the others. User mistakes (a bad config key, a missing
path, a grid that cannot work) print one `error: ...` line and exit with 2; a training run
that fails exits with 1; Ctrl-C exits with 130; SIGTERM stops a training run after a
checkpoint and exits with 143.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fourfold.errors import EXIT_FAILED, EXIT_USAGE, FourfoldError, first_line
from fourfold.parsing import ArgumentParser
from fourfold.signals import EXIT_INTERRUPTED, EXIT_TERMINATED, StopSignals, Stopped

if TYPE_CHECKING:
    from fourfold.config import Config

EXIT_OK = 0
EXIT_TRAINING_FAILED = EXIT_FAILED  # also: a command whose module is missing


# --------------------------------------------------------------------------------------------
# Errors


def _message(error: BaseException) -> str:
    """One line for the user: a missing file names the path, anything else its message."""
    if isinstance(error, (FileNotFoundError, NotADirectoryError)) and error.filename:
        return f"{error.filename}: {error.strerror or 'not found'}"
    return first_line(error)


# --------------------------------------------------------------------------------------------
# train


def default_run_dir(env: dict[str, str] | None = None, now: float | None = None) -> Path:
    """`runs/<timestamp>`, or, inside a multi-rank job, a name every rank derives alike.

    Ranks of one job start at slightly different times, so a timestamp could differ between
    them; the job's own id (Slurm's job id, torchrun's run id) cannot.
    """
    env = dict(os.environ) if env is None else env
    if int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")) or 1) > 1:
        if env.get("SLURM_JOB_ID"):
            # Two steps of one job (srun ... & srun ...) are two runs.
            step = env.get("SLURM_STEP_ID", "0")
            suffix = f".{step}" if step.isdigit() and 0 < int(step) < 4294967290 else ""
            return Path("runs") / f"slurm-{env['SLURM_JOB_ID']}{suffix}"
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        if run_id and run_id != "none":
            return Path("runs") / run_id
        from fourfold.config import ConfigError

        raise ConfigError("this job has several ranks but no shared run id; pass --out RUN_DIR "
                          "so that every rank writes to the same run directory")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs") / stamp


def _rank_argv(argv: list[str], run_dir: Path | None = None) -> list[str]:
    """What each rank that --nproc launches runs: the command as typed, minus --nproc; with
    `run_dir`, `--out run_dir` is added (the ranks must not each pick a timestamp of their own)."""
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            out.append(item)
    return out + (["--out", str(run_dir)] if run_dir is not None else [])


def cmd_train(args: argparse.Namespace) -> int:
    from fourfold.config import ConfigError, load_config

    from fourfold.rundir import CONFIG_FILE, check_resume_requested, hold_run_dir

    # CONFIG may be a run directory: its own config.toml, and the run goes on there
    given_run = args.config is not None and (Path(args.config) / CONFIG_FILE).is_file()
    cfg = load_config(args.config, args.overrides, saved=given_run)
    if args.resume is not None:
        cfg.checkpoint.resume = args.resume
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts {args.max_restarts}: must not be negative")
        cfg.train.max_restarts = args.max_restarts
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: must be at least 1")
    named = bool(args.out) or given_run
    run_dir = Path(args.out) if args.out else Path(args.config) if given_run else \
        default_run_dir()
    if args.resume:
        check_resume_requested(run_dir, named)
    # One job trains in a named run directory at a time: the job's first process holds its
    # lock (the ranks that --nproc starts, under their launcher's); runs/<time> is new.
    from fourfold.launch import LAUNCHED_BY_FOURFOLD

    holds = named and _is_main_rank() and LAUNCHED_BY_FOURFOLD not in os.environ
    with hold_run_dir(run_dir) if holds else contextlib.nullcontext():
        return _train_in(args, cfg, run_dir, named)


def _train_in(args: argparse.Namespace, cfg: Config, run_dir: Path, named: bool) -> int:
    """cmd_train once the run directory is known (and held)."""
    from fourfold.rundir import list_checkpoints, move_checkpoints_aside

    if args.resume is False and _is_main_rank() and list_checkpoints(run_dir):
        # a fresh run must neither resume them later nor prune them now: set aside, kept
        moved = move_checkpoints_aside(run_dir)
        print(f"note: --no-resume: moved the old checkpoints of {run_dir} to {moved}",
              file=sys.stderr, flush=True)

    _note_slurm_launch(args.nproc)
    if args.nproc > 1 and not _inside_job():
        from fourfold.launch import launch_local
        from fourfold.parallel.grid import GridShape

        # Mistakes the ranks would each find (and each print) are reported once, here.
        p = cfg.parallel
        GridShape.resolve(p.x, p.y, p.z, p.data, args.nproc)
        return launch_local(args.nproc,
                            _rank_argv(args.argv, None if named else run_dir),
                            max_restarts=cfg.train.max_restarts)

    from fourfold.train.trainer import train

    args.signals.install()  # SIGTERM: stop after a checkpoint
    result = train(cfg, run_dir, signals=args.signals)
    if _is_main_rank():
        _print_train_summary(Path(getattr(result, "run_dir", run_dir)))
    return EXIT_OK


def _inside_job() -> bool:
    """Whether this process is already one rank of a job started by torchrun or srun.

    Under Slurm only a task of a job step of several tasks is (srun sets the step's
    variables); a batch script carries the job's SLURM_PROCID and SLURM_NTASKS but is one
    process, which --nproc may fan out."""
    from fourfold.slurm import slurm_rank_env

    return "RANK" in os.environ or bool(slurm_rank_env(os.environ))


def _is_main_rank() -> bool:
    # Slurm's variable counts before init_distributed has copied it to RANK.
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0"
    from fourfold.slurm import is_slurm_step

    return not is_slurm_step(os.environ) or os.environ.get("SLURM_PROCID", "0") == "0"


def _note_slurm_launch(nproc: int) -> None:
    """Say what fourfold makes of a Slurm allocation when it differs from what the job asked:
    --nproc inside a step of several tasks (the step's tasks are the ranks), or one process
    in a batch script of a job of several tasks (the script is not one of them)."""
    env = os.environ
    if "RANK" in env or "SLURM_JOB_ID" not in env:
        return
    from fourfold.slurm import is_slurm_step

    tasks = int(env.get("SLURM_STEP_NUM_TASKS" if is_slurm_step(env) else "SLURM_NTASKS", "1")
                or 1)
    if is_slurm_step(env) and tasks > 1 and nproc > 1 and _is_main_rank():
        print(f"note: --nproc {nproc} ignored: the {tasks} tasks of this srun step are the "
              "ranks", file=sys.stderr, flush=True)
    elif not is_slurm_step(env) and tasks > 1 and nproc == 1:
        print(f"note: Slurm job {env['SLURM_JOB_ID']} has {tasks} tasks but this batch script "
              "is one process, so fourfold trains on one rank; start the ranks with `srun "
              "python -m fourfold train ...` or `fourfold train ... --nproc N`",
              file=sys.stderr, flush=True)


def _print_train_summary(run_dir: Path) -> None:
    """Where the run's files are and what to do with them (the trainer has already shown the
    losses and the final sample)."""
    files = sorted(p.name for p in run_dir.iterdir()
                   if not p.name.startswith(".")) if run_dir.is_dir() else []
    listing = f" ({', '.join(files)})" if files else ""
    print(f"run files: {run_dir}{listing}")
    print(f"next: fourfold generate {run_dir} --prompt 'def ' | fourfold report {run_dir}",
          flush=True)


# --------------------------------------------------------------------------------------------
# prepare, generate, eval, plan


def cmd_prepare(args: argparse.Namespace) -> int:
    from fourfold.data.prepare import prepare_main

    return prepare_main(args.inputs, args.out, args.tokenizer, overwrite=args.overwrite,
                        data_format=args.format, train_on=args.train_on)


def cmd_generate(args: argparse.Namespace) -> int:
    from fourfold.config import ConfigError
    from fourfold.train.runs import load_trained, run_tokenizer
    from fourfold.train.sampling import generate

    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must not be negative")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must not be negative "
                          "(0 picks the most likely token)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k}: must not be negative (0 keeps every token)")
    model, cfg = load_trained(args.run_dir)
    tokenizer = run_tokenizer(args.run_dir, cfg)
    if args.chat:
        return _generate_chat(args, model, cfg, tokenizer)
    prompt_ids = [int(i) for i in tokenizer.encode(args.prompt)]
    if not prompt_ids:
        raise ConfigError("--prompt '': the prompt must hold at least one token")
    new_ids = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, eos_id=tokenizer.eos_id,
                       vocab_size=tokenizer.vocab_size)
    print(args.prompt + tokenizer.decode(new_ids), flush=True)
    return EXIT_OK


def _generate_chat(args: argparse.Namespace, model, cfg, tokenizer) -> int:  # noqa: ANN001
    """`generate --chat`: the prompt as a user's turn in the run's chat template (its data's,
    or the documented default), the answer generated to the template's end of turn."""
    from fourfold.data.chat_template import data_template, encode_with_offsets
    from fourfold.train.runs import run_template_dir
    from fourfold.train.sampling import generate

    template = data_template(run_template_dir(args.run_dir, cfg), tokenizer)
    prompt_ids = template.prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    stop = template.end_of_turn()
    stop_ids = encode_with_offsets(tokenizer, stop)[0] if stop else []
    eos = int(stop_ids[0]) if len(stop_ids) == 1 else tokenizer.eos_id
    new_ids = generate(model, [int(i) for i in prompt_ids], args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                       eos_id=eos, vocab_size=tokenizer.vocab_size)
    answer = tokenizer.decode(new_ids)
    print(answer.split(stop)[0] if stop else answer, flush=True)
    return EXIT_OK


def cmd_eval_memorization(args: argparse.Namespace) -> int:
    from fourfold.eval.memorization import MemorizationAuditError, memorization_main

    if args.nproc < 1:
        raise MemorizationAuditError(f"--nproc {args.nproc}: must be at least 1")
    if args.nproc > 1 and not _inside_job():
        from fourfold.launch import launch_local
        from fourfold.parallel.grid import GridShape

        GridShape.resolve(args.x, args.y, args.z, "auto", args.nproc)  # one error, not N
        return launch_local(args.nproc, _rank_argv(args.argv))
    return memorization_main(str(args.run_dir), str(args.data), args.docs, args.prefix,
                             args.suffix, args.json, x=args.x, y=args.y, z=args.z)


def cmd_simulate(args: argparse.Namespace) -> int:
    from fourfold.simulate import simulate_main

    return simulate_main(args.config, args.world, args.grid, args.ranks, args.machine,
                         args.overrides, args.device, whole_run=not args.steps_only)


def cmd_plan(argv: list[str]) -> int:
    from fourfold.plan.cli import plan_main
    from fourfold.simulate import simulate_planned

    return plan_main(argv, simulate_planned)


# --------------------------------------------------------------------------------------------
# report, convert


def cmd_report(args: argparse.Namespace) -> int:
    from fourfold.report import write_report

    for path in write_report(Path(args.run_dir)):
        print(path)
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from fourfold.export import export_hf

    for path in export_hf(args.run_dir, args.out_dir, merge=args.merge,
                          overwrite=args.overwrite):
        print(path)
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# Parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fourfold")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="fourfold",
                     description="Train Llama-family models with 4D hybrid parallelism.")
    parser.add_argument("--version", action="version", version=f"fourfold {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True

    train = sub.add_parser("train", help="train a model (on N local ranks with --nproc N)",
                           description="Train a model. Under torchrun or srun each rank runs "
                                       "this same command.")
    train.add_argument("config", nargs="?", metavar="CONFIG.toml",
                       help="a config file, or a RUN_DIR to go on with (its config.toml; the run "
                            "resumes there); defaults apply "
                            "without one")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")
    train.add_argument("--out", metavar="RUN_DIR",
                       help="where checkpoints, metrics and samples go (default runs/<time>)")
    train.add_argument("--nproc", type=int, default=1, metavar="N",
                       help="start N local ranks (ignored inside torchrun/srun jobs)")
    train.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                       help="continue from RUN_DIR's latest checkpoint (checkpoint.resume, "
                            "on by default; --resume: an error without one; --no-resume: "
                            "old checkpoints are moved aside)")
    train.add_argument("--max-restarts", type=int, default=None, metavar="N",
                       help="restart failed ranks up to N times (train.max_restarts)")
    train.set_defaults(handler=cmd_train)

    simulate = sub.add_parser(
        "simulate", help="run the build and a two-step run of chosen ranks of an N-rank job in one "
                         "process, with fake collectives and tensors, beside the planner",
        description="Build chosen ranks of an N-rank job and run a two-step run of each "
                    "through Trainer.fit (the log, validations, a checkpoint's staging, the "
                    "final export and sample; no tensor written), under torch's fake process "
                    "group and fake tensors (no memory, no GPU; --device: real tensors and "
                    "kernels); print their peak tensor "
                    "memory by phase and bytes per axis beside the planner's, and fail when a "
                    "rank does not fit or the ranks of a group would issue different "
                    "collectives.")
    simulate.add_argument("config", nargs="?", metavar="CONFIG.toml",
                          help="a config file (defaults apply without one)")
    simulate.add_argument("--world", type=int, required=True, metavar="N",
                          help="ranks of the simulated job")
    simulate.add_argument("--grid", metavar="D,Z,Y,X",
                          help="the grid (default: the config's parallel section, or the "
                               "planner's choice with parallel.auto)")
    simulate.add_argument("--ranks", metavar="R,...",
                          help="ranks to simulate (default: the first and last on each axis)")
    simulate.add_argument("--machine", metavar="NAME|MACHINE.toml",
                          help="the machine as in `fourfold plan` (default parallel.machine)")
    simulate.add_argument("--set", dest="overrides", action="append", default=[],
                          metavar="SECTION.KEY=VALUE", help="override one config key")
    simulate.add_argument("--device", choices=("cpu", "cuda"),
                          help="real shards and kernels on this device, collectives still fake: "
                               "the real peak memory and compute time per step (default: fake "
                               "tensors, no memory)")
    simulate.add_argument("--steps-only", action="store_true",
                          help="the two steps alone, outside Trainer.fit (no log, "
                               "validation, sample, checkpoint or export): on rank 0 of a very "
                               "large job the export's assembly of every full tensor takes "
                               "minutes")
    simulate.set_defaults(handler=cmd_simulate)

    prepare = sub.add_parser("prepare", help="tokenize text into a DATA_DIR of token shards")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help="text files, directories, .jsonl or .parquet files")
    prepare.add_argument("--out", required=True, metavar="DATA_DIR")
    prepare.add_argument("--tokenizer", default="byte",
                         help="byte | bpe:VOCAB_SIZE | PATH/tokenizer.json (default byte)")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace what DATA_DIR holds (the old data stays whole until the "
                              "new is complete)")
    prepare.add_argument("--format", default="text", metavar="FORMAT",
                         help="text | chat (records with 'messages') | instruct (prompt/"
                              "completion or instruction/input/output) (default text)")
    prepare.add_argument("--train-on", default="assistant", metavar="WHAT",
                         help="chat and instruct data: assistant (its answers; the prompt is "
                              "not trained) | all (default assistant)")
    prepare.set_defaults(handler=cmd_prepare)

    gen = sub.add_parser("generate", help="continue a prompt with a trained model")
    gen.add_argument("run_dir", metavar="RUN_DIR")
    gen.add_argument("--prompt", required=True, metavar="TEXT")
    gen.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.8, metavar="T",
                     help="0 picks the most likely token every time")
    gen.add_argument("--top-k", type=int, default=50, metavar="K", help="0 keeps every token")
    gen.add_argument("--seed", type=int, default=1337, metavar="S")
    gen.add_argument("--chat", action="store_true",
                     help="the prompt is a user's message: put it in the run's chat template "
                          "and print the answer")
    gen.set_defaults(handler=cmd_generate)

    evaluate = sub.add_parser("eval", help="evaluate a trained model")
    eval_sub = evaluate.add_subparsers(dest="eval_command", metavar="EVAL",
                                       parser_class=ArgumentParser)
    eval_sub.required = True
    mem = eval_sub.add_parser("memorization",
                              help="how much training text the model reproduces verbatim")
    mem.add_argument("run_dir", metavar="RUN_DIR")
    mem.add_argument("--data", required=True, metavar="DATA_DIR",
                     help="the data the run trained on (a DATA_DIR or builtin:stdlib)")
    mem.add_argument("--docs", type=int, default=100, metavar="N",
                     help="training documents to test (default 100)")
    mem.add_argument("--prefix", type=int, default=32, metavar="P",
                     help="prompt length in tokens (default 32)")
    mem.add_argument("--suffix", type=int, default=32, metavar="S",
                     help="tokens generated and compared (default 32)")
    mem.add_argument("--json", action="store_true", help="print JSON instead of a table")
    mem.add_argument("--nproc", type=int, default=1, metavar="N",
                     help="audit on N local ranks (ignored inside torchrun/srun jobs)")
    for axis in ("x", "y", "z"):
        mem.add_argument(f"--{axis}", type=int, default=1, metavar="N",
                         help=f"grid size along {axis} on several ranks (default 1; "
                              "the remaining ranks replicate over data)")
    mem.set_defaults(handler=cmd_eval_memorization)

    # Registered for --help only: main() hands `plan`'s arguments to the planner unparsed.
    sub.add_parser("plan", help="predict time and memory of configurations, pick the best",
                   add_help=False)
    sub.add_parser("probe", help="(under torchrun/srun) measure GEMMs and collectives, write "
                   "a MACHINE.toml for plan", add_help=False)

    report = sub.add_parser("report", help="plot a run's loss, tokens/s and memory")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.set_defaults(handler=cmd_report)

    convert = sub.add_parser("convert", help="export a run as a Hugging Face checkpoint")
    convert.add_argument("run_dir", metavar="RUN_DIR")
    convert.add_argument("--to", required=True, choices=["hf"], help="target format")
    convert.add_argument("out_dir", metavar="OUT_DIR")
    convert.add_argument("--merge", action="store_true",
                         help="an adapter run: the merged model (without: the base checkpoint "
                              "in OUT_DIR and the peft adapter in OUT_DIR/adapter)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace what OUT_DIR holds (it stays as it was until the export "
                              "is complete)")
    convert.set_defaults(handler=cmd_convert)
    return parser


def _dispatch(argv: list[str], signals: StopSignals) -> int:
    if argv and argv[0] == "plan":
        return cmd_plan(argv[1:])
    if argv and argv[0] == "probe":  # planner-owned, like plan: its own parser
        from fourfold.plan.probe import probe_main

        return probe_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # as typed: what --nproc's ranks run again
    args.signals = signals
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


def main(argv: list[str] | None = None) -> int:
    """Run the `fourfold` command; returns the exit code.

    Run as a program (argv None) in a process that joined a multi-rank job, it leaves through
    `_leave_job` instead of returning: see there why.
    """
    if argv is None:
        from fourfold.host import restart_for_cpu_training

        restart_for_cpu_training(sys.argv)
    code = _run(sys.argv[1:] if argv is None else list(argv))
    if argv is None:
        _leave_job(code)
    return code


def _notice(message: Warning | str) -> None:
    """A ConfigNotice as one `warning: ...` line, once per job (a rank that fourfold's own
    launcher started leaves it to the launcher, which loaded the same config)."""
    from fourfold.launch import LAUNCHED_BY_FOURFOLD

    main_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    if main_rank and os.environ.get(LAUNCHED_BY_FOURFOLD) != "1":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _run(argv: list[str]) -> int:
    from fourfold.errors import ConfigNotice

    with warnings.catch_warnings():
        def show(message: Warning | str, category: type[Warning], *where: Any) -> None:
            if issubclass(category, ConfigNotice):
                _notice(message)
            else:  # one line, without the source path a user cannot act on
                print(f"warning: {first_line(str(message))}", file=sys.stderr, flush=True)

        warnings.showwarning = show
        return _run_command(argv)


def _run_command(argv: list[str]) -> int:
    signals = StopSignals()
    try:
        return _dispatch(argv, signals)
    except SystemExit as exit_:  # argparse: --help, --version
        code = exit_.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_USAGE)
    except KeyboardInterrupt:
        _report_stop("interrupted")
        return EXIT_INTERRUPTED
    except Stopped as stopped:
        _report_stop(str(stopped))
        return stopped.exit_code
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("fourfold."):
            raise
        # A partial install (or a part still being written): name the piece, no traceback.
        print(f"error: this command needs {error.name}, which is not installed",
              file=sys.stderr, flush=True)
        return EXIT_TRAINING_FAILED
    except (FourfoldError, FileNotFoundError, NotADirectoryError) as error:
        # every error meant for the user is a FourfoldError that knows its exit code
        _report_error(_message(error), every_rank=getattr(error, "every_rank", False))
        return error.exit_code if isinstance(error, FourfoldError) else EXIT_USAGE
    except Exception:
        if not signals.any:
            raise
        # a collective whose peer a signal ended first: the signal is the news, not this
        _report_stop("interrupted" if signals.interrupted else "terminated")
        return EXIT_INTERRUPTED if signals.interrupted else EXIT_TERMINATED
    finally:
        signals.uninstall()


def _report_error(message: str, every_rank: bool = False) -> None:
    """Print `error: message` once per job.

    A rank started by an elastic launcher (ours or torchrun) also leaves the line in its
    error file, where the launcher's failure summary picks it up. Under `fourfold train
    --nproc` that summary is the one line the user sees (a rank that fails second may be
    stopped before it could print); otherwise rank 0 prints, since every rank usually finds
    the same mistake, or, with `every_rank`, each rank (when rank 0 may not exist).
    """
    from fourfold.launch import LAUNCHED_BY_FOURFOLD, write_error_file

    launched = write_error_file(message) and os.environ.get(LAUNCHED_BY_FOURFOLD) == "1"
    if not launched and (every_rank or _is_main_rank()):
        print(f"error: {message}", file=sys.stderr, flush=True)


def _report_stop(line: str) -> None:
    """Say once per job why it stopped: the main rank, and not a rank of fourfold's own
    launcher on Ctrl-C (the launcher, which saw it too, says it)."""
    from fourfold.launch import LAUNCHED_BY_FOURFOLD

    launched = os.environ.get(LAUNCHED_BY_FOURFOLD) == "1"
    if _is_main_rank() and not (launched and line == "interrupted"):
        print(line, file=sys.stderr, flush=True)


def _leave_job(code: int) -> None:
    """End a rank process that joined a torch.distributed job (see parallel.leave_job)."""
    dist_module = sys.modules.get("torch.distributed")
    if dist_module is None:
        return  # never imported torch.distributed: nothing to leave
    from fourfold.parallel import leave_job

    leave_job(code)
