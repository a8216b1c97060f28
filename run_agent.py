"""The one command line of the lab.

    python run_agent.py --budget 60gpuh [--lab DIR] [--session NAME] [--planner playbook|openai]
                        [--executor local|slurm]        run a research session (the default command)
    python run_agent.py verify [--lab DIR] [--expect-head HASH]
                                                        re-walk the notebook's decision hash chain
    python run_agent.py check-feedback FILE [--lab DIR] validate a feedback file and print its summary (with a lab:
                                                        its overlap with the lab's eval prompts and its split)
    python run_agent.py world build [--lab DIR] [--seed N] [--size demo|test]
                                                        build (or find cached) the toy world
    python run_agent.py world truth CHECKPOINT [--vs OTHER|opponent] [--n 2000]
                                                        true win rate in the toy world (noise-free oracle)
    python run_agent.py check-bundle DIR [--lab DIR]     check a serving bundle (template, reload, consistency)
    python run_agent.py report [--lab DIR] [--session S] [-o FILE]
                                                        one self-contained HTML report of a session (DIR/report.html)
    python run_agent.py close SESSION --why "..." [--lab DIR]
                                                        end a stuck session: its open jobs cancelled, why recorded
    python run_agent.py clear-suite SESSION SUITE --by NAME --reason "..." [--lab DIR]
                                                        clear a suite the suite audit flagged: its guards read their
                                                        registered margin again

Exit status: 0 on success, 1 when a check fails (verify, check-bundle), 2 on bad input (flags, lab.toml, files);
bad input writes nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import LAB_FILE, BudgetError, LabConfig, LabConfigError, load_lab_config, parse_budget
from agent.errors import SessionError
from core.redact import install_log_redaction, redact

if TYPE_CHECKING:
    from memory.notebook import Notebook

NOTEBOOK_FILE = "notebook.db"
SESSION_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", re.ASCII)


class UsageError(Exception):
    """Bad input from the command line; exit status 2, nothing written."""


# ---- run (default) -------------------------------------------------------------------------------


DEFAULT_LAB = Path("lab")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", required=True, help="GPU budget: 60gpuh, 0.5gpuh (GPU-hours) or 90gpum (GPU-minutes)")
    p.add_argument("--lab", type=Path, help="lab directory (holds lab.toml and notebook.db); default ./lab, where the "
                   "toy world is built when it holds no lab.toml")
    p.add_argument("--session", help="session name (default: s-<UTC timestamp>)")
    p.add_argument("--planner", choices=["playbook", "openai"], help="override [planner] kind of lab.toml")
    p.add_argument("--executor", choices=["local", "slurm"], help="override [executor] kind of lab.toml")
    p.add_argument("--protocol", choices=["full", "test", "short"], default="full",
                   help="playbook size: full, test (one SFT arm of 4 steps, one dose, one serving alternative) or short "
                        "(two screened arms, one dose: the decision-quality benchmark)")
    p.add_argument("--recipe", choices=["combined", "aspen", "brook", "delta", "ember", "islet"],
                   help="the playbook's named policy: the combined playbook (default) or one seed's recipe; overrides "
                        "[playbook] recipe of lab.toml")
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of the live view")


def cmd_run(args: argparse.Namespace) -> int:
    named_lab, args.lab = args.lab is not None, args.lab or DEFAULT_LAB
    budget = parse_budget(args.budget)
    session = args.session or datetime.now(UTC).strftime("s-%Y%m%d-%H%M%S")
    if not SESSION_NAME_RE.fullmatch(session):  # fullmatch: `$` would let a trailing newline through
        raise UsageError(f"--session {session!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    config = _lab_config(args)
    planner = args.planner or (config.planner.kind if config else "playbook")
    executor = args.executor or (config.executor.kind if config else "local")
    if config is None and (planner, executor) != ("playbook", "local"):
        raise UsageError(f"{args.lab / LAB_FILE}: --planner openai and --executor slurm need a lab.toml that configures them")
    if config and planner == "openai" and not (config.planner.base_url and config.planner.model):
        raise UsageError(f"{args.lab / LAB_FILE}: --planner openai needs [planner] base_url and model")
    if config and executor == "slurm" and config.executor.slurm is None:
        raise UsageError(f"{args.lab / LAB_FILE}: --executor slurm needs an [executor.slurm] section")
    path = args.lab / NOTEBOOK_FILE
    if path.exists() and session in _session_names(path):
        raise UsageError(f"session {session!r} already exists in {path}; pick another --session name")
    from tools.paths import LabPaths

    holder = LabPaths(root=args.lab).writer_holding()  # a held lab is named first: its inputs may be mid-change
    if holder is not None:
        raise UsageError(f"{LabPaths(root=args.lab).lock}: the lab is in use by {holder}; one writer at a time (wait "
                         "for it to end, or use another --lab)")
    if config is not None:  # every input file is read before any notebook row is written (issue 10, item 3)
        from agent.inputs import feedback_control_warning, feedback_notes, require_inputs

        require_inputs(config, args.lab / LAB_FILE, os.environ, planner, executor)
        from core.display import shown  # notes name the lab's files and battle ids: someone else's text

        for note in feedback_notes(config):
            print(shown(note, keep_newlines=True))
        warning = feedback_control_warning(config)  # check-feedback --lab's line: counts and lines, never the text
        if warning is not None:
            print(warning, file=sys.stderr)
    if config is None and named_lab and not args.lab.is_dir():
        # A mistyped --lab is not a request for the toy world: that is built without --lab (in ./lab) or by
        # `world build --lab DIR`. A directory with files but no lab.toml is refused by check_build below.
        raise UsageError(f"--lab {args.lab}: no such directory; a lab is a directory holding {LAB_FILE} (to build the "
                         f"toy world there, run `run_agent.py world build --lab {args.lab}` first; without --lab the "
                         "toy world is built in ./lab)")
    if config is None:
        from tools.world.build import WorldError, build, check_build

        try:
            check_build(args.lab, 0, "demo")  # before the lock file: a refused build leaves nothing behind
        except WorldError as exc:
            raise UsageError(str(exc)) from None
    from agent.runner import start

    with LabPaths(root=args.lab, session=session).writer(f"run {session}"):
        if config is None:  # no lab configured: the embedded toy world, built (or found cached) in the lab dir
            from core.display import shown

            print(shown(f"no {args.lab / LAB_FILE}: building the toy world in {args.lab} (cached after the first build)"))
            build(args.lab, size="demo")
        return start(args.lab, session, budget, planner, executor, args.protocol, args.quiet, recipe=args.recipe)


# ---- resume / replay -----------------------------------------------------------------------------


def add_resume_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", help="the session to continue")
    p.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory (holds lab.toml and notebook.db)")
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of the live view")


def cmd_resume(args: argparse.Namespace) -> int:
    from agent.runner import resume
    from tools.paths import LabPaths

    path = args.lab / NOTEBOOK_FILE
    if not path.exists():  # before the lock, which would create the lab directory
        raise UsageError(f"{path}: no notebook here (pass --lab DIR)")
    from memory.schema import file_problem

    problem = file_problem(path)  # a directory or a damaged file says what it is, as every other command does
    if problem:
        raise UsageError(f"{path}: {problem}")
    with LabPaths(root=args.lab, session=args.session).writer(f"resume {args.session}"):
        return resume(args.lab, args.session, args.quiet)


WHY_LIMIT = 500  # characters of a closing reason: one line a reviewer reads


def add_close_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", help="the open session to end (stuck: a job pending forever, a lab that changed)")
    p.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory (holds lab.toml and notebook.db)")
    p.add_argument("--why", required=True, help="why it is closed: recorded in its stop decision")


def _existing_notebook(lab: Path) -> Path:
    """The lab's notebook, refused unless it exists and reads as one; checked before the writer lock, which would
    create the lab directory."""
    from memory.schema import file_problem

    path = lab / NOTEBOOK_FILE
    if not path.exists():
        raise UsageError(f"{path}: no notebook here (pass --lab DIR)")
    problem = file_problem(path)
    if problem:
        raise UsageError(f"{path}: {problem}")
    return path


def cmd_close(args: argparse.Namespace) -> int:
    from agent.closing import close
    from tools.paths import LabPaths

    why = " ".join(args.why.split())
    if not why or len(why) > WHY_LIMIT:
        raise UsageError(f"--why: say why the session is closed, in 1-{WHY_LIMIT} characters")
    _existing_notebook(args.lab)
    # The writer lock: the session's own agent must be stopped first (it would go on submitting).
    with LabPaths(root=args.lab).writer(f"close {args.session}"):
        return close(args.lab, args.session, why)


NAME_LIMIT = 64  # characters of who cleared a suite: a name or handle, shown on the card


def add_clear_suite_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", help="the session whose suite audit flagged the suite")
    p.add_argument("suite", help="the flagged suite (a suite of the session's bars)")
    p.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory (holds lab.toml and notebook.db)")
    p.add_argument("--by", required=True, help="who clears it: recorded in its clear_suite decision, shown on the card")
    p.add_argument("--reason", required=True, help="why the suite can be trusted again (its labels were checked, ...)")


def cmd_clear_suite(args: argparse.Namespace) -> int:
    from agent.clearing import clear
    from tools.paths import LabPaths

    by, reason = " ".join(args.by.split()), " ".join(args.reason.split())
    if not by or len(by) > NAME_LIMIT:
        raise UsageError(f"--by: name who clears the suite, in 1-{NAME_LIMIT} characters")
    if not reason or len(reason) > WHY_LIMIT:
        raise UsageError(f"--reason: say why the suite can be trusted again, in 1-{WHY_LIMIT} characters")
    _existing_notebook(args.lab)
    # The writer lock: a running agent reads the flag at its next comparison; the person's decision waits for it.
    with LabPaths(root=args.lab).writer(f"clear-suite {args.session}"):
        return clear(args.lab, args.session, args.suite, by, reason)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", help="the session to re-derive")
    p.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory (holds lab.toml and notebook.db)")
    p.add_argument("--bars", type=Path, help="other bars (TOML) registered in place of the session's")
    p.add_argument("--planner", choices=["playbook", "openai"], help="another planner than the session's")
    p.add_argument("--protocol", choices=["full", "test", "short"], help="another playbook size than the session's")


def cmd_replay(args: argparse.Namespace) -> int:
    from agent.replay import replay_command

    return replay_command(args.lab, args.session, bars=args.bars, planner=args.planner, protocol=args.protocol)


def _lab_config(args: argparse.Namespace) -> LabConfig | None:
    """The lab's config, or None for the embedded toy world (no lab.toml in the lab directory)."""
    if os.path.lexists(args.lab) and not args.lab.is_dir():
        raise UsageError(f"--lab {args.lab}: not a directory" if args.lab.exists() else
                         f"--lab {args.lab}: a symbolic link to nothing (or a loop)")
    # lexists: a dangling or looping lab.toml symlink is a broken lab, never "no lab.toml, so the toy world".
    if not os.path.lexists(args.lab / LAB_FILE):
        return None
    return load_lab_config(args.lab)


def _open_readonly(path: Path) -> Notebook:
    from memory.notebook import Notebook

    return Notebook.open(path, readonly=True)


def _session_names(path: Path) -> set[str]:
    with _open_readonly(path) as nb:
        return {s.name for s in nb.sessions()}


# ---- verify --------------------------------------------------------------------------------------


def add_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory (holds notebook.db)")
    p.add_argument("--expect-head", help="hash the chain must end at (pins the tail against truncation)")


def cmd_verify(args: argparse.Namespace) -> int:
    path = args.lab / NOTEBOOK_FILE
    if not path.exists():
        raise UsageError(f"{path}: no notebook here (run a session first, or pass --lab DIR)")
    from core.display import shown  # the lab's name is a user's choice: printed escaped

    with _open_readonly(path) as nb:
        report = nb.verify()
    if not report.ok:
        print(shown(f"{path}: verify FAILED after {report.count} good decisions: {report.problem}"), file=sys.stderr)
        return 1
    if args.expect_head and args.expect_head != report.head:
        print(f"{shown(str(path))}: verify FAILED: the chain ends at {report.head}, expected {shown(args.expect_head)} "
              "(decisions were removed from the end, or this is another notebook)", file=sys.stderr)
        return 1
    print(f"{shown(str(path))}: {report.count} decisions verified; head {report.head}")
    return 0


# ---- check-feedback ------------------------------------------------------------------------------


def add_check_feedback_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="feedback file: JSONL, or Parquet with the same columns")
    p.add_argument("--lab", type=Path, help="also check the file as that lab would ingest it: battles carrying its "
                   "tokenizer's special tokens, battles whose prompts copy its eval prompts (dropped from every "
                   "training set), groups of colliding prompts past the bound, and a split that would be empty or "
                   "skewed (exit 1)")


def cmd_check_feedback(args: argparse.Namespace) -> int:
    from tools.data.feedback import check_feedback_command

    if args.lab is None:
        return check_feedback_command(args.file)
    config = _lab_config(args)  # before the file: the lab's tokenizer names control strings of its own
    if config is None:
        raise UsageError(f"--lab {args.lab}: no {LAB_FILE} there")
    from agent.inputs import feedback_notes, feedback_split_problems, lab_controls

    status = check_feedback_command(args.file, lab_controls(config))
    if status != 0:
        return status

    config = config.model_copy(update={"feedback": config.feedback.model_copy(update={"file": args.file})})
    from core.display import shown  # battle ids and file names are someone else's text

    for note in feedback_notes(config):
        print(shown(note, keep_newlines=True))
    problems = feedback_split_problems(config)
    for problem in problems:
        print(shown(problem, keep_newlines=True), file=sys.stderr)
    return 1 if problems else 0


# ---- world ---------------------------------------------------------------------------------------


def add_world_args(p: argparse.ArgumentParser) -> None:
    from tools.world.cli import add_args

    add_args(p)


def cmd_world(args: argparse.Namespace) -> int:
    from tools.world.cli import main as world_main

    return world_main(args)


# ---- check-bundle --------------------------------------------------------------------------------


def add_check_bundle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=Path, help="the bundle directory to check")
    p.add_argument("--lab", type=Path, help="lab directory whose notebook must hold the bundle's last decision")


def cmd_check_bundle(args: argparse.Namespace) -> int:
    from tools.nomination.check_bundle import check_bundle_command

    return check_bundle_command(args.bundle, args.lab)


# ---- report --------------------------------------------------------------------------------------


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory (holds notebook.db)")
    p.add_argument("--session", help="session to report (default: the latest one)")
    p.add_argument("-o", "--output", type=Path, help="HTML file to write (default: LAB/report.html)")


def cmd_report(args: argparse.Namespace) -> int:
    from core.display import shown
    from memory.report import write_report

    session, out = write_report(args.lab / NOTEBOOK_FILE, args.session, args.output or args.lab / "report.html")
    print(f"{shown(str(out))}: report of session {session.name} ({out.stat().st_size} bytes)")
    return 0


# ---- dispatch ------------------------------------------------------------------------------------

SUBCOMMANDS = {
    "run": (add_run_args, cmd_run, "run a research session (the default command)"),
    "verify": (add_verify_args, cmd_verify, "re-walk the notebook's decision hash chain"),
    "check-feedback": (add_check_feedback_args, cmd_check_feedback, "validate a feedback file and summarize it"),
    "check-bundle": (add_check_bundle_args, cmd_check_bundle, "check a serving bundle (template, reload, consistency)"),
    "world": (add_world_args, cmd_world, "build the toy world, or measure a checkpoint's ground truth in it"),
    "resume": (add_resume_args, cmd_resume, "continue a session that died, launching nothing twice"),
    "close": (add_close_args, cmd_close, "end a stuck session: cancel its open jobs, record why (a stop decision)"),
    "clear-suite": (add_clear_suite_args, cmd_clear_suite, "clear a suite the suite audit flagged (a person's "
                    "decision): its guards read their registered margin again"),
    "replay": (add_replay_args, cmd_replay, "re-derive a session's decisions from the notebook (no jobs, no writes)"),
    "report": (add_report_args, cmd_report, "write one self-contained HTML report of a session, read from the notebook"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_agent.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="run_agent.py [COMMAND] [OPTIONS]   (no COMMAND: run, e.g. run_agent.py --budget 60gpuh)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add_args, handler, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(handler=handler)
        if name == "run":
            lines = p.format_help().split("\n\n", 2)[-1].splitlines()
            options = "\n".join(line for line in lines if line != "options:" and "--help" not in line)
            parser.epilog = ("the default command, run (`run_agent.py --budget 60gpuh` is `run_agent.py run --budget "
                             f"60gpuh`):\n{options}\nexit status: 0 success, 1 a check failed, 2 bad input "
                             "(nothing written).")
    return parser


def _glue_budget(argv: list[str]) -> list[str]:
    # `--budget -1gpuh` would read as a flag to argparse; glue the value so the budget parser explains.
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--budget":
            out[i : i + 2] = [f"--budget={out[i + 1]}"]
            break
    return out


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input (exit 2). The notebook module (sqlite-utils pulls in pandas) is
    imported only by commands that open a notebook, so `check-feedback` starts fast; if a handler raised a
    NotebookError, that module is loaded by then."""
    errors: list[type[BaseException]] = [UsageError, BudgetError, LabConfigError, SessionError]
    paths = sys.modules.get("tools.paths")
    if paths is not None:  # another writer holds the lab: refused like bad input, nothing written
        errors.append(paths.LabLockError)
    notebook = sys.modules.get("memory.notebook")
    if notebook is not None:
        errors.append(notebook.NotebookError)
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # the default command: `run_agent.py --budget 60gpuh`
    argv = _glue_budget(argv)
    args = build_parser().parse_args(argv)
    install_log_redaction()
    try:
        return args.handler(args)
    except _bad_input_errors() as exc:
        from core.display import one_line, shown  # a message names paths a user chose: escaped, never raw

        # One line: a refusal listing several problems (require_inputs, a feedback file's bad lines) joins them.
        print(f"error: {shown(one_line(redact(str(exc))))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
