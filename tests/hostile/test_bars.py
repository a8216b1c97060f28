"""Hostile bars files (issue 10, item 5): each refused at load with the file and bar index, every
problem of a file listed; at the CLI a lab with such a bars file exits 2 and writes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evals import bars, constraints, length_stop, loops, mcq, synthetic
from evals import math as math_scorer
from evals.types import Item, completion_from_text

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import assert_refused, files, make_lab, run_cli  # noqa: E402

SUITES = {"math": "math", "ifeval": "constraints"}
P = 'suite = "math"\nmetric = "correct"\ntest = "paired_t"\n'


def _bar(rule: str, suite: str = "math", metric: str = "correct", extra: str = "") -> str:
    return f'[[bar]]\nsuite = "{suite}"\nmetric = "{metric}"\nrule = "{rule}"\n{extra}'


HOSTILE = {
    "unknown suite": (_bar("delta >= 0", suite="maths"), ["bar[0].suite: unknown suite 'maths' (the lab evaluates: ifeval, math)"]),
    "unknown metric": (_bar("delta >= 0") + _bar("delta >= 0", metric="acc"),
                       ["bar[1].metric: suite 'math' (scorer math) has no metric 'acc' (it has: correct, no_answer)"]),
    "duplicate bar": (_bar("delta >= -1 * noise_floor") + _bar("delta >= -1.0*noise_floor"), ["bar[1]: the same bar as bar[0]"]),
    "crossing bounds": (_bar("delta > 0.1") + _bar("delta <= 0.1"), ["bar[0] and bar[1]: no value of math/correct delta"]),
    "ci_low above ci_high": (_bar("ci_low >= 0.2") + _bar("ci_high < 0.1"), ["bar[0] and bar[1]: no value of math/correct ci_low and ci_high"]),
    "p above 1": ("p_family = 4\n" + _bar("p <= 1.5", extra='test = "paired_t"\n'), ["bar[0]: rule 'p <= 1.5': a p threshold must lie in (0, 1]"]),
    "p zero": ("p_family = 4\n" + _bar("p < 0", extra='test = "paired_t"\n'), ["bar[0]: rule 'p < 0': a p threshold must lie in (0, 1]"]),
    "p from below": ("p_family = 4\n" + _bar("p >= 0.05", extra='test = "paired_t"\n'), ["bar[0]: rule 'p >= 0.05': a p bar bounds p from above"]),
    "p_family too small": ("p_family = 1\n" + _bar("p <= 0.05", extra='test = "paired_t"\n')
                           + _bar("p <= 0.05", metric="no_answer", extra='test = "wilcoxon"\n'),
                           ["p_family: p_family = 1 is smaller than the 2 p bars"]),
    "infinite number": (_bar("delta >= 1e999"), ["bar[0]: rule 'delta >= 1e999': the number must be finite"]),
    "nan confidence": (_bar("ci_low > 0", extra="confidence = nan\n"), ["bar[0].confidence: Input should be a finite number"]),
    "string for a number": ('p_family = "10"\n' + _bar("delta >= 0", extra='confidence = "0.9"\n'),
                            ["bar[0].confidence: Input should be a valid number (got '0.9')", "p_family: Input should be a valid integer (got '10')"]),
    "bool for a number": ("p_family = true\n" + _bar("delta >= 0"), ["p_family: Input should be a valid integer (got True)"]),
    "huge p_family": ("p_family = " + "9" * 5000 + "\n" + _bar("delta >= 0"), ["not valid TOML: Exceeds the limit (4300 digits)"]),
    "p_family out of range": ("p_family = 9223372036854775807\n" + _bar("delta >= 0"), ["p_family: Input should be less than or equal to 1000000"]),
    "deep nesting": (_bar("delta >= 0", extra="x = " + "[" * 3000 + "]" * 3000 + "\n"), ["not valid TOML: nested too deeply"]),
    "no bars": ("p_family = 3\n", ["bar: at least one [[bar]] table is needed"]),
    "unknown key": ("alpha = 0.05\n" + _bar("delta >= 0", extra="weight = 2\n"),
                    ["alpha: unknown key", "bar[0].weight: unknown key"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bars_are_refused_with_file_and_bar_index(tmp_path: Path, case: str):
    text, expected = HOSTILE[case]
    path = tmp_path / "bars.toml"
    path.write_text(text)
    with pytest.raises(bars.BarsError) as err:
        bars.load(path, SUITES)
    assert str(err.value).startswith(f"{path}: ")
    for words in expected:
        assert words in str(err.value), (words, str(err.value))


def test_every_problem_of_a_file_is_listed(tmp_path: Path):
    path = tmp_path / "bars.toml"
    path.write_text('p_family = "2"\n' + _bar("delta >= 0", suite="maths") + _bar("p <= 2", extra='test = "paired_t"\n')
                    + _bar("t > 2", metric="acc", extra="confidence = 7\n") + _bar("delta >= 0", suite="maths"))
    with pytest.raises(bars.BarsError) as err:
        bars.load(path, SUITES)
    assert len(err.value.problems) == 7, err.value.problems
    for where in ("p_family:", "bar[0].suite", "bar[1]: rule 'p <= 2'", "bar[2].confidence", "bar[2].metric",
                  "bar[3].suite", "bar[3]: the same bar as bar[0]"):
        assert where in str(err.value), where


def test_non_utf8_and_unreadable_bars_files(tmp_path: Path):
    path = tmp_path / "bars.toml"
    path.write_bytes(_bar("delta >= 0").encode() + b'# caf\xe9\n')
    with pytest.raises(bars.BarsError, match=r"bars.toml: 1 problem\(s\):\n  line 5: not valid UTF-8 \(byte 0xe9\)"):
        bars.load(path)
    with pytest.raises(bars.BarsError, match="is a directory, not a file"):
        bars.load(tmp_path)
    with pytest.raises(bars.BarsError, match="not valid TOML"):
        path.write_text("[[bar]\n")
        bars.load(path)


def test_bars_in_a_lab_refuse_the_session_at_the_cli(tmp_path: Path):
    cases = {
        "metric": (_bar("delta >= 0", metric="acc").encode(), "bar[0].metric: suite 'math' (scorer math) has no metric 'acc'"),
        "p": (("p_family = 1\n" + _bar("p <= 1.5", extra='test = "paired_t"\n')).encode(), "bar[0]: rule 'p <= 1.5'"),
        "utf8": (_bar("delta >= 0").encode() + b"# \xff\n", "line 5: not valid UTF-8"),
    }
    labs = {}
    for name, (data, _) in cases.items():
        lab = make_lab(tmp_path / name)
        (lab / "bars.toml").write_bytes(data)
        labs[name] = (lab, files(lab))
    procs = run_cli([["--budget", "1gpuh", "--lab", str(labs[n][0])] for n in cases])
    for (name, (_, words)), proc in zip(cases.items(), procs, strict=True):
        lab, before = labs[name]
        assert_refused(proc.returncode, proc.stderr, str(lab / "bars.toml"), words)
        assert files(lab) == before and not (lab / "notebook.db").exists()


def test_the_metric_table_matches_what_the_scorers_write():
    """SCORER_METRICS is what bars are checked against; the scorers that need no model are run here."""
    item = Item(id="i", messages=({"role": "user", "content": "2+2?"},), gold="4", choices=("3", "4"))
    constrained = Item(id="c", messages=({"role": "user", "content": "two words"},),
                       constraints=({"kind": "word_count", "relation": "exactly", "n": 2},))
    comp = [completion_from_text("i", "The answer is 4. B", 5, True)]
    written = {
        "math": math_scorer.score([item], comp), "mcq": mcq.score([item], comp), "loops": loops.score([item], comp),
        "length_stop": length_stop.score([item], comp),
        "synthetic": synthetic.score([synthetic.generate("digit_sum", 1, seed=0)[0].item],
                                     [completion_from_text(synthetic.generate("digit_sum", 1, seed=0)[0].item.id, "7", 1, True)]),
        "constraints": [*constraints.score([constrained], [completion_from_text("c", "two words", 2, True)]),
                        *constraints.score([constrained], [completion_from_text("c", "two words", 2, True)], mode="ifeval")],
    }
    for scorer, outcomes in written.items():
        keys = set().union(*(o.values for o in outcomes))
        assert keys and keys <= bars.SCORER_METRICS[scorer], (scorer, keys - bars.SCORER_METRICS[scorer])
