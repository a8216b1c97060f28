"""The `ifeval` scoring mode against lm-eval's IFEval checkers, and the plain mode's named differences.

lm-eval (a dev dependency, like TRL for the losses) is the reference. Three things are patched in
it, and nothing else:
- `nltk.download` during import: lm-eval's `instructions_util` tries to download punkt_tab when it
  is imported; here there is no network, so the call is recorded and refused.
- punkt itself: `instructions_util._get_sentence_tokenizer` (number_sentences) and
  `nltk.tokenize.sent_tokenize` (inside `nltk.word_tokenize`, capital_word_frequency) are given the
  project's splitter, `evals.constraint_rules.split_sentences`, since punkt's model cannot be had.
- langdetect's seed: its default draws a fresh random seed per call; the reference is run with
  seed 0, the seed the project's detector uses.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import pytest
from pydantic import TypeAdapter

from evals import constraints, ifeval
from evals.constraint_rules import Constraint, split_sentences

CORPUS = Path(__file__).parent / "corpus" / "ifeval_cases.jsonl"
RULE = TypeAdapter(Constraint)


class _SplitterAsPunkt:
    """Stands where lm-eval expects nltk's punkt tokenizer object."""

    def tokenize(self, text: str) -> list[str]:
        return split_sentences(text)


@contextlib.contextmanager
def reference_module():
    """lm-eval's ifeval `utils` module, imported and run with the patches above."""
    import langdetect
    import nltk
    import nltk.tokenize

    downloads: list[tuple] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(nltk, "download", lambda *a, **k: downloads.append(a) or False))
        from lm_eval.tasks.ifeval import instructions_util, utils

        stack.enter_context(mock.patch.object(instructions_util, "_get_sentence_tokenizer", _SplitterAsPunkt))
        stack.enter_context(mock.patch.object(nltk.tokenize, "sent_tokenize",
                                              lambda text, language="english": split_sentences(text)))
        stack.enter_context(mock.patch.object(langdetect.DetectorFactory, "seed", 0))
        yield utils


def reference_verdicts(utils, instructions: list[dict], response: str) -> tuple[list[bool], list[bool]]:
    """lm-eval's per-instruction strict and loose verdicts on one response."""
    inp = utils.InputExample(key=0, instruction_id_list=[x["id"] for x in instructions], prompt="",
                             kwargs=[x["kwargs"] for x in instructions])
    strict = utils.test_instruction_following_strict(inp, response).follow_instruction_list
    loose = utils.test_instruction_following_loose(inp, response).follow_instruction_list
    return [bool(v) for v in strict], [bool(v) for v in loose]


def ours(instructions: list[dict], response: str) -> tuple[list[bool], list[bool]]:
    verdicts = [ifeval.follows(ifeval.from_ifeval(x["id"], x["kwargs"]), response) for x in instructions]
    return [s for s, _ in verdicts], [lo for _, lo in verdicts]


def _cases() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference():
    with reference_module() as utils:
        yield utils


def test_corpus_covers_every_registered_instruction(reference):
    from lm_eval.tasks.ifeval import instructions_registry

    cases = _cases()
    assert len(cases) >= 300
    used = {x["id"] for case in cases for x in case["instructions"]}
    assert used == set(instructions_registry.INSTRUCTION_DICT) == set(ifeval.IFEVAL_IDS)


def test_ifeval_mode_equals_lm_eval_on_every_case(reference):
    """Every case: our strict and loose verdicts == lm-eval's now == lm-eval's when the corpus was built."""
    disagree = []
    for case in _cases():
        ref = reference_verdicts(reference, case["instructions"], case["response"])
        mine = ours(case["instructions"], case["response"])
        if mine != ref or ref != (case["ref_strict"], case["ref_loose"]):
            disagree.append((case["id"], case["instructions"], case["response"], mine, ref))
    assert not disagree, f"{len(disagree)} cases disagree, first: {disagree[:3]}"


# ---- the plain mode's departures from the reference, one named case each ------------------------
# (name, IFEval instruction, kwargs, response, plain verdict); the reference verdict is the opposite
# and is read live from lm-eval, so each row pins a difference that really exists.
DIFFERENCES = [
    ("words_apostrophe_is_one_word", "length_constraints:number_words", {"num_words": 3, "relation": "at least"},
     "don't stop", False),
    ("words_hyphen_is_one_word", "length_constraints:number_words", {"num_words": 3, "relation": "less than"},
     "x-ray vision", True),
    ("paragraph_divider_inside_bold_italic", "length_constraints:number_paragraphs", {"num_paragraphs": 2},
     "***bold italic*** text\n***\nmore", True),
    ("paragraph_doubled_divider", "length_constraints:number_paragraphs", {"num_paragraphs": 2},
     "p1\n***\n***\np2", True),
    ("first_word_past_markdown", "length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "summer"}, "**Summer** is here.\n\nWinter follows.", True),
    ("first_word_ends_at_colon", "length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "summer"}, "Summer: here.\n\nWinter follows.", True),
    ("paragraph_break_with_spaces", "length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "b"}, "a\n \nb", True),
    ("bullet_needs_marker_and_space", "detectable_format:number_bullet_lists", {"num_bullets": 1},
     "-5 degrees\n- a", True),
    ("emphasis_line_is_not_a_bullet", "detectable_format:number_bullet_lists", {"num_bullets": 1},
     "*emphasis* first\n* a", True),
    ("keyword_is_a_whole_word", "keywords:existence", {"keywords": ["cat"]}, "A category of things.", False),
    ("keyword_is_literal_not_regex", "keywords:existence", {"keywords": ["e.g."]}, "I like eggs.", False),
    # Python >= 3.11 reads "C++" as a possessive "C+": the reference finds it in any text with a C.
    ("keyword_plus_plus_is_literal", "keywords:existence", {"keywords": ["C++"]}, "I like C.", False),
    ("keyword_count_whole_words", "keywords:frequency", {"keyword": "go", "frequency": 3, "relation": "at least"},
     "go gone going go", False),
    ("forbidden_plus_plus_is_literal", "keywords:forbidden_words", {"forbidden_words": ["C++"]}, "I like C.", True),
    ("forbidden_word_ending_in_dot", "keywords:forbidden_words", {"forbidden_words": ["e.g."]}, "e.g. this", False),
    ("undetectable_language_fails", "language:response_language", {"language": "en"}, "12345 67890", False),
    ("end_phrase_is_case_exact", "startend:end_checker", {"end_phrase": "Any other questions?"},
     "Done. any other questions?", False),
    ("capital_word_needs_two_letters", "change_case:capital_word_frequency",
     {"capital_frequency": 1, "capital_relation": "at least"}, "I am here", False),
    ("capital_contraction_is_one_word", "change_case:capital_word_frequency",
     {"capital_frequency": 3, "capital_relation": "at least"}, "DON'T STOP", False),
    ("fullwidth_comma_is_a_comma", "punctuation:no_comma", {}, "full\uff0cwidth", False),
    ("empty_brackets_are_no_placeholder", "detectable_content:number_placeholders", {"num_placeholders": 1},
     "Empty [] and [ ] boxes.", False),
    ("section_header_opens_a_line", "detectable_format:multiple_sections",
     {"section_spliter": "Section", "num_sections": 1}, "see Section 2 above", False),
    ("multiplication_is_no_highlight", "detectable_format:number_highlighted_sections", {"num_highlights": 1},
     "2 * 3 * 4", False),
    ("postscript_opens_a_line", "detectable_content:postscript", {"postscript_marker": "P.S."}, "I help.s. all", False),
    ("typographic_quotes_wrap", "startend:quotation", {}, "\u201ccurly quotes\u201d", True),
    ("repeat_ignores_rewrapping", "combination:repeat_prompt", {"prompt_to_repeat": "Write a\npoem."},
     "Write a poem. Roses.", True),
    ("constrained_needs_one_option", "detectable_format:constrained_response", {},
     "My answer is no. My answer is yes.", False),
    ("seven_stars_do_not_separate", "combination:two_responses", {}, "A\n*******\nB", False),
    ("responses_differing_in_spacing_are_one", "combination:two_responses", {}, "Same  thing.\n******\nSame thing.",
     False),
    ("json_fence_with_language_tag", "detectable_format:json_format", {}, '```python\n{"a": 1}\n```', True),
]


@pytest.mark.parametrize(("instruction", "kwargs", "response", "plain"), [d[1:] for d in DIFFERENCES],
                         ids=[d[0] for d in DIFFERENCES])
def test_plain_mode_differs_from_reference(reference, instruction, kwargs, response, plain):
    rule = ifeval.from_ifeval(instruction, kwargs)
    ref_strict, _ = reference_verdicts(reference, [{"id": instruction, "kwargs": kwargs}], response)
    assert ref_strict == [not plain]
    assert ifeval.follows(rule, response)[0] == (not plain)
    assert rule.check(response) == plain


def test_divider_between_blank_lines_is_not_a_paragraph(item, completion):
    rule = RULE.validate_python({"kind": "paragraph_count", "n": 2})
    out = constraints.score([item("p", constraints=(rule,))], [completion("p", "First.\n\n***\n\nSecond.")])[0]
    assert out.values["strict"] == 1.0


def test_keywords_ending_in_non_letters_match_where_they_stand():
    forbidden = RULE.validate_python({"kind": "forbidden_words", "forbidden": ["C++", "e.g."]})
    assert not forbidden.check("I write C++ daily.") and not forbidden.check("Fruit, e.g., apples")
    assert forbidden.check("I write C++11 and C#.") and forbidden.check("eggs")
    count = RULE.validate_python({"kind": "keyword_frequency", "keyword": "C++", "relation": "exactly", "n": 2})
    assert count.check("C++ and c++, not C.") and not count.check("C++ only")


@pytest.mark.parametrize("mode", ["plain", "ifeval"])
def test_blank_answer_follows_nothing_strict_or_loose(item, completion, mode):
    rules = tuple(RULE.validate_python(r) for r in ({"kind": "no_commas"}, {"kind": "word_count",
                                                     "relation": "at_most", "n": 5}))
    for text in ("", "   \n  "):
        out = constraints.score([item("e", constraints=rules)], [completion("e", text)], mode=mode)[0]
        assert out.label == "fail"
        assert max(v for k, v in out.values.items() if k.endswith(("strict", "loose"))) == 0.0


def test_loose_never_fails_what_strict_passes(item, completion):
    # One line: dropping the first or last line leaves nothing, and the answer itself still counts.
    rule = RULE.validate_python({"kind": "no_commas"})
    for mode in ("plain", "ifeval"):
        out = constraints.score([item("o", constraints=(rule,))], [completion("o", "no commas")], mode=mode)[0]
        assert out.label == "pass" and out.values["scoring_mode_ifeval"] == float(mode == "ifeval")


def test_ifeval_mode_metrics_name_the_mode(item, completion):
    rules = tuple(RULE.validate_python(r) for r in ({"kind": "no_commas"}, {"kind": "all_lowercase"},
                                                     {"kind": "title"}))
    items = [item("a", constraints=rules), item("b", constraints=rules[:1])]
    comps = [completion("a", "Hello there"), completion("b", "fine")]
    from evals.types import suite_metrics

    m = suite_metrics(constraints.score(items, comps, mode="ifeval"))
    assert m["ifeval_strict"] == 0.5 and m["scoring_mode_ifeval"] == 1.0
    # IFEval's instruction-level accuracy: 2 of 4 instructions followed.
    assert m["ifeval_strict_followed"] / m["ifeval_instructions"] == 0.5
    plain = suite_metrics(constraints.score(items, comps))
    assert plain["scoring_mode_ifeval"] == 0.0 and not any(k.startswith("ifeval_") for k in plain)


def test_from_ifeval_refuses_what_the_reference_would_randomise_or_crash_on(reference):
    with pytest.raises(ValueError, match="unknown IFEval instruction id"):
        ifeval.from_ifeval("keywords:key_sentences", {})
    with pytest.raises(ValueError, match=r"missing or empty \['num_words'\].*at random"):
        ifeval.from_ifeval("length_constraints:number_words", {"num_words": 0, "relation": "at least"})
    with pytest.raises(ValueError, match="unknown"):
        ifeval.from_ifeval("punctuation:no_comma", {"letter": "a"})
    with pytest.raises(ValueError, match="exceeds num_paragraphs"):
        ifeval.from_ifeval("length_constraints:nth_paragraph_first_word",
                           {"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "x"})
    with pytest.raises(ValueError, match="'less than' or 'at least'"):
        ifeval.from_ifeval("keywords:frequency", {"keyword": "a", "frequency": 2, "relation": "at most"})
    # A keyword that is no regular expression: the reference crashes, this mode refuses up front.
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ifeval.from_ifeval("keywords:existence", {"keywords": ["(optional"]})
    with pytest.raises(Exception, match="missing \\)"):
        reference_verdicts(reference, [{"id": "keywords:existence", "kwargs": {"keywords": ["(optional"]}}], "x")
    # None values (as in the published dataset's rows) are absent keys, as in the reference.
    assert ifeval.from_ifeval("punctuation:no_comma", {"letter": None, "num_words": None}).kind == "no_commas"


def test_project_sentence_splitter_where_punkt_would_differ():
    """Punkt (not loadable here) knows far more abbreviations; these pin what this splitter does."""
    assert split_sentences("Dr. Smith came. He sat.") == ["Dr. Smith came.", "He sat."]
    assert split_sentences("The U.S. grew. J. K. Rowling wrote. So do I. Yes") == [
        "The U.S. grew.", "J. K. Rowling wrote.", "So do I.", "Yes"]
    assert split_sentences("Wait... what?! OK") == ["Wait...", "what?!", "OK"]
    assert split_sentences("It costs $3.50 now.\nNext line") == ["It costs $3.50 now.", "Next line"]
    # Unknown abbreviations split where punkt's learned list would not.
    assert len(split_sentences("See Gen. Lee at 5 p.m. today. Then go.")) == 3


def test_eval_job_scores_a_constraints_suite_in_the_mode_its_spec_names(tmp_path, item, completion):
    from evals import job

    rule = RULE.validate_python({"kind": "word_count", "relation": "at_least", "n": 3})
    items, comps = [item("w", constraints=(rule,))], [completion("w", "don't stop")]
    for mode, metric, value in (("plain", "strict", 0.0), ("ifeval", "ifeval_strict", 1.0)):
        spec = job.SuiteSpec(name="if", scorer="constraints", items_path=tmp_path / "x.jsonl", constraint_mode=mode)
        outs, _ = job.score(spec, items, comps, None, None)
        assert outs[0].values[metric] == value
    with pytest.raises(ValueError, match="constraint_mode applies to constraints suites only"):
        job.SuiteSpec(name="m", scorer="mcq", items_path=tmp_path / "x.jsonl", constraint_mode="ifeval")


def test_ifeval_rows_become_a_constraints_suite(tmp_path, completion):
    rows = [
        {"key": 1, "prompt": "Write a haiku without commas.", "instruction_id_list": ["punctuation:no_comma"],
         "kwargs": [{}]},
        {"key": 2, "prompt": "Say hi twice.", "instruction_id_list": ["keywords:frequency", "startend:quotation"],
         "kwargs": [{"keyword": "hi", "frequency": 2, "relation": "at least", "num_words": None}, {}]},
    ]
    src, out = tmp_path / "rows.jsonl", tmp_path / "items.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ifeval.main([str(src), str(out)]) == 0
    from evals.job import read_items

    items = read_items(out)
    assert [i.id for i in items] == ["1", "2"] and items[1].prompt == "Say hi twice."
    outs = constraints.score(items, [completion("1", "leaves fall, softly"), completion("2", '"hi hi"')], mode="ifeval")
    assert [o.values["ifeval_strict"] for o in outs] == [0.0, 1.0]


def test_bad_ifeval_rows_named_by_line_exit_2_and_write_nothing(tmp_path):
    import subprocess
    import sys

    src, out = tmp_path / "rows.jsonl", tmp_path / "items.jsonl"
    good = {"key": 1, "prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    bad = {"key": 2, "prompt": "p", "instruction_id_list": ["length_constraints:number_words"],
           "kwargs": [{"num_words": 50}]}
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    proc = subprocess.run([sys.executable, "-m", "evals.ifeval", str(src), str(out)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{src}:2: length_constraints:number_words" in proc.stderr and "missing or empty ['relation']" in proc.stderr
    assert not out.exists()


# Plain-mode fixes of the same class as the three, found by reading the rules against the
# instructions they check: (name, rule, answer, verdict) where the old rule said the opposite.
PLAIN_FIXES = [
    ("letterless_answer_is_not_lowercase", {"kind": "all_lowercase"}, "123 !", False),
    ("letterless_answer_is_not_uppercase", {"kind": "all_uppercase"}, "123 !", False),
    ("star_rule_is_not_a_bullet", {"kind": "bullet_count", "n": 2}, "* a\n* * *\n* b", True),
    ("bold_counts_as_highlight", {"kind": "highlights", "n": 2}, "**one** and *two*", True),
    ("markdown_section_headers", {"kind": "sections", "n": 2}, "## SECTION 1\na\n**SECTION 2**\nb", True),
    ("bold_postscript", {"kind": "postscript"}, "Body.\n**P.S.** see you", True),
    ("end_phrase_inside_closing_quote", {"kind": "ends_with", "suffix": "Bye."}, '"Hello. Bye."', True),
    ("dash_rule_between_paragraphs", {"kind": "paragraph_count", "n": 2}, "One.\n\n---\n\nTwo.", True),
    ("keyword_standing_alone_only", {"kind": "include_keywords", "keywords": ["cat"]}, "A category.", False),
]


@pytest.mark.parametrize(("rule", "text", "verdict"), [f[1:] for f in PLAIN_FIXES], ids=[f[0] for f in PLAIN_FIXES])
def test_plain_rule_fixes(rule, text, verdict):
    assert RULE.validate_python(rule).check(text) == verdict
