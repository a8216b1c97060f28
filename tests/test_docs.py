"""The READMEs are true to the code: their length, the commands and make targets they name, the files they point at.

README.md is a user's document (at most 450 lines) and bench/README.md the current result of each benchmark (at most
250). Every `python run_agent.py ...` either names (command, `world` subcommand, every `--flag`) exists in the CLI's
own parser; every `make TARGET` is a Makefile target; every bench/results file bench/README.md names exists, and every
file in bench/results is named there or by a test or bench script; every relative link and repository path resolves.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import run_agent

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCH_README = REPO / "bench" / "README.md"
RESULTS = REPO / "bench" / "results"
LIMITS = {README: 450, BENCH_README: 250}
DOCS = (README, BENCH_README)

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")
MAKE = re.compile(r"(?<![\w./-])make\s+([a-z][\w-]*)")
# `--out PATH` says where a command writes, not that the file exists yet.
RESULT_REF = re.compile(r"(--out\s+)?(?:bench/)?results/([\w.-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
TOP_DIRS = ("agent", "tools", "trainers", "evals", "memory", "core", "bench", "tests", "docs", "scripts", "requirements")


def code_texts(path: Path) -> list[str]:
    """The code of a markdown file, one text per command: each line of a fenced or indented block (its `#`
    comment cut), and each inline span (line breaks inside it folded)."""
    text = path.read_text(encoding="utf-8")
    texts = []
    for block in FENCE.findall(text):
        texts += [line.split(" #")[0] for line in block.splitlines()]
    prose = FENCE.sub("", text)
    indented = [line for line in prose.splitlines() if line.startswith("    ") and line.strip()]
    texts += [line.split(" #")[0] for line in indented]
    body = "\n".join(line for line in prose.splitlines() if not line.startswith("    "))
    texts += [" ".join(span.split()) for span in INLINE.findall(body)]
    return texts


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def cli_problems(code: str) -> list[str]:
    """What in one `python run_agent.py ...` the CLI does not have: its command, `world` subcommand or flags."""
    problems = []
    commands = _subparsers(run_agent.build_parser())
    for tail in re.findall(r"python3?\s+run_agent\.py((?:\s+[^\s;&]+)*)", code):
        words = [w for w in tail.replace("[", " ").replace("]", " ").replace("\\|", " ").split() if w]
        if not words or FLAG.match(words[0]):
            name, rest = "run", words
        else:
            name, rest = words[0], words[1:]
        if name not in commands:
            problems.append(f"`{code}`: no command {name!r} (run_agent.py has {sorted(commands)})")
            continue
        parser = commands[name]
        if _subparsers(parser):  # world build / world truth
            sub = rest[0] if rest else ""
            if sub not in _subparsers(parser):
                problems.append(f"`{code}`: no `{name} {sub}` (it has {sorted(_subparsers(parser))})")
                continue
            parser, rest = _subparsers(parser)[sub], rest[1:]
        unknown = [w for w in rest if FLAG.match(w) and w not in _options(parser)]
        problems += [f"`{code}`: `{name}` has no option {w}" for w in unknown]
    return problems


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_readme_lengths(doc: Path):
    lines = len(doc.read_text(encoding="utf-8").splitlines())
    assert lines <= LIMITS[doc], f"{doc.relative_to(REPO)} has {lines} lines; at most {LIMITS[doc]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_named_commands_exist(doc: Path):
    texts = code_texts(doc)
    named = [t for t in texts if re.search(r"python3?\s+run_agent\.py", t)]
    assert named, f"{doc.name} names no run_agent.py command: the parser of this test is wrong"
    problems = [p for t in named for p in cli_problems(t)]
    targets = make_targets()
    problems += [f"`{t}`: no Makefile target {m!r}" for t in texts for m in MAKE.findall(t) if m not in targets]
    assert not problems, "\n".join(problems)


def test_cli_check_catches_what_is_not_there():
    # The check itself: a wrong command, subcommand or flag is caught, a right one is not.
    assert cli_problems("python run_agent.py --budget 60gpuh [--lab DIR] [--protocol full\\|short]") == []
    assert cli_problems("python run_agent.py world truth CKPT --vs opponent --n 400") == []
    assert cli_problems("python run_agent.py resume SESSION --lab DIR --quiet") == []
    assert cli_problems("python run_agent.py bless SESSION")
    assert cli_problems("python run_agent.py world grow")
    assert cli_problems("python run_agent.py report --budget 1gpuh")
    assert cli_problems("python run_agent.py --dry-run --budget 1gpuh")


def test_bench_results_named_exist():
    text = BENCH_README.read_text(encoding="utf-8")
    named = {name for out, name in RESULT_REF.findall(text) if not out and name != "..."}
    assert len(named) >= 10, "bench/README.md names too few results: the parser of this test is wrong"
    missing = sorted(n for n in named if not (RESULTS / n).exists())
    assert not missing, f"bench/README.md names results that do not exist: {missing}"
    top = README.read_text(encoding="utf-8")
    missing = sorted(n for out, n in RESULT_REF.findall(top) if not out and not (RESULTS / n).exists())
    assert not missing, f"README.md names results that do not exist: {missing}"


def test_every_result_is_named():
    """A file in bench/results that nothing names is a superseded result nobody reads: name it or remove it."""
    readers = [BENCH_README, *(REPO / "bench").glob("*.py"), *(REPO / "bench").glob("*.sh"), *(REPO / "tests").rglob("*.py")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in readers if p != Path(__file__).resolve())
    unnamed = sorted(p.name for p in RESULTS.iterdir() if p.name not in text)
    assert not unnamed, f"bench/results files named by neither bench/README.md nor a test or bench script: {unnamed}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_and_paths_resolve(doc: Path):
    text = doc.read_text(encoding="utf-8")
    problems = [f"link ({t})" for t in LINK.findall(text)
                if "://" not in t and not t.startswith("#") and not (doc.parent / t.split("#")[0]).exists()]
    for code in code_texts(doc):
        words = re.split(r"[\s()\[\]\"',:;=]+", code)
        for before, word in zip(["", *words], words, strict=False):
            word = word.rstrip(".")
            if before == "--out" or "/" not in word or any(c in word for c in "<>*{}$") or "..." in word:
                continue
            if word.split("/")[0] in TOP_DIRS and not (REPO / word).exists():
                problems.append(f"path {word}")
    assert not problems, f"{doc.name} ({doc.parent.name}/) points at what does not exist: {problems}"
