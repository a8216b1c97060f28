"""IFEval scoring mode: the reference semantics of every constraint rule, for IFEval-comparable numbers.

The reference is google-research's instruction_following_eval as carried in lm-eval 0.4.13
(`lm_eval/tasks/ifeval/instructions.py` and `utils.py`); these functions are written here from its
behaviour and checked against it case by case (tests/evals/test_scorer_ifeval.py, a corpus in
tests/evals/corpus/ifeval_cases.jsonl). Its quirks are kept on purpose, because a number quoted as
IFEval must mean what everyone else's does: keywords are regular expressions searched anywhere,
words are `\\w+` runs, paragraphs split only at `***`, an undetectable language passes, and so on.

Two pieces of the reference need nltk's punkt model, which cannot be downloaded here: sentence
counting (`number_sentences`) and the sentence split inside nltk's word tokenizer
(`capital_word_frequency`). Both use the project's splitter (`constraint_rules.split_sentences`)
instead; the word tokenizer itself is nltk's (`NLTKWordTokenizer`, no data needed). See that
function's docstring for where it and punkt part ways.

Strict and loose follow `utils.test_instruction_following_strict/_loose`: an answer that is blank
fails every instruction; loose passes an instruction if any of eight edits of the answer (stars
removed, first and/or last line dropped) is non-blank and passes it.

`evals/constraints.py` calls `follows(rule, text)` when a suite is scored with `mode="ifeval"`;
`from_ifeval(instruction_id, kwargs)` turns an IFEval instruction into the rule it checks, and the
command below turns IFEval's rows (`key`, `prompt`, `instruction_id_list`, `kwargs`, one JSON
object a line, as in its input_data.jsonl) into the items file of a constraints suite:

    .venv/bin/python -m evals.ifeval IFEVAL_ROWS.jsonl ITEMS.jsonl
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from core.chat import Message
from core.jsonl import read_values
from core.util import write_atomic
from evals import constraint_rules as cr
from evals.types import Item

_RELATIONS = {"less than": "less_than", "at least": "at_least"}


def _regex(pattern: str, rule: str) -> str:
    """The reference compiles user text as a regex; one that does not compile is an error there too."""
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{rule}: {pattern!r} is not a valid regular expression ({err}); "
                         "the IFEval reference searches it as one") from err
    return pattern


def _keywords(rule: cr.IncludeKeywords, text: str) -> bool:
    return all(re.search(_regex(k, rule.kind), text, flags=re.IGNORECASE) for k in rule.keywords)


def _keyword_frequency(rule: cr.KeywordFrequency, text: str) -> bool:
    count = len(re.findall(_regex(rule.keyword, rule.kind), text, flags=re.IGNORECASE))
    return cr.compare(count, rule.relation, rule.n)


def _forbidden(rule: cr.ForbiddenWords, text: str) -> bool:
    return not any(re.search(rf"\b{_regex(w, rule.kind)}\b", text, flags=re.IGNORECASE) for w in rule.forbidden)


def _letters(rule: cr.LetterFrequency, text: str) -> bool:
    return cr.compare(collections.Counter(text.lower())[rule.letter.lower()], rule.relation, rule.n)


def _language(rule: cr.ResponseLanguage, text: str) -> bool:
    detected = cr.detect_language(text)
    return detected is None or detected == rule.language  # undetectable counts as followed


def _sentences(rule: cr.SentenceCount, text: str) -> bool:
    return cr.compare(len(cr.split_sentences(text)), rule.relation, rule.n)


def _split_stars(text: str) -> int | None:
    """Paragraphs split at `***` with one optional space each side; None if one inside is empty."""
    parts = re.split(r"\s?\*\*\*\s?", text)
    count = len(parts)
    for index, part in enumerate(parts):
        if not part.strip():
            if index not in (0, len(parts) - 1):
                return None
            count -= 1
    return count


def _paragraphs(rule: cr.ParagraphCount, text: str) -> bool:
    if rule.separator == "divider":
        return _split_stars(text) == rule.n
    # No reference rule counts blank-line paragraphs; this is nth_paragraph_first_word's count.
    return sum(1 for p in text.split("\n\n") if p.strip()) == rule.n


def _first_word(paragraph: str) -> str:
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = ""
    for letter in word:
        if letter in ".,?!'\"":
            break
        first += letter.lower()
    return first


def _nth_first_word(rule: cr.NthParagraphFirstWord, text: str) -> bool:
    parts = text.split("\n\n")
    count = sum(1 for p in parts if p.strip())
    # The reference indexes the raw split, blank pieces included, with the non-blank count as bound.
    if rule.nth_paragraph > count or not parts[rule.nth_paragraph - 1].strip():
        return False
    return count == rule.num_paragraphs and _first_word(parts[rule.nth_paragraph - 1].strip()) == rule.first_word.lower()


def _words(rule: cr.WordCount, text: str) -> bool:
    return cr.compare(len(re.findall(r"\w+", text)), rule.relation, rule.n)


def _placeholders(rule: cr.Placeholders, text: str) -> bool:
    return len(re.findall(r"\[.*?\]", text)) >= rule.n


def _postscript(rule: cr.Postscript, text: str) -> bool:
    patterns = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}
    pattern = patterns.get(rule.marker, r"\s*" + _regex(rule.marker.lower(), rule.kind) + r".*$")
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


def _bullets(rule: cr.BulletCount, text: str) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == rule.n


def _constrained(rule: cr.ConstrainedResponse, text: str) -> bool:
    body = text.strip()
    return any(option in body for option in rule.options)


def _highlights(rule: cr.Highlights, text: str) -> bool:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= rule.n


def _sections(rule: cr.Sections, text: str) -> bool:
    parts = re.split(r"\s?" + _regex(rule.marker, rule.kind) + r"\s?\d+\s?", text)
    return cr.compare(len(parts) - 1, rule.relation, rule.n)


def _json(rule: cr.JsonFormat, text: str) -> bool:
    body = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    try:
        json.loads(body.removesuffix("```").strip())
    except ValueError:
        return False
    return True


def _title(rule: cr.Title, text: str) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


def _two_responses(rule: cr.TwoResponses, text: str) -> bool:
    parts = text.split("******")
    answers = []
    for index, part in enumerate(parts):
        if part.strip():
            answers.append(part)
        elif index not in (0, len(parts) - 1):
            return False
    return len(answers) == 2 and answers[0].strip() != answers[1].strip()


def _repeat(rule: cr.RepeatRequest, text: str) -> bool:
    return text.strip().lower().startswith(rule.request.strip().lower())


def _ends(rule: cr.EndsWith, text: str) -> bool:
    return text.strip().strip('"').lower().endswith(rule.suffix.strip().lower())


@functools.cache
def _word_tokenizer():
    from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


def word_tokens(text: str) -> list[str]:
    """nltk.word_tokenize with the project's sentence splitter in place of punkt."""
    tokenizer = _word_tokenizer()
    return [tok for sentence in cr.split_sentences(text) for tok in tokenizer.tokenize(sentence)]


def _capitals(rule: cr.CapitalWords, text: str) -> bool:
    return cr.compare(sum(tok.isupper() for tok in word_tokens(text)), rule.relation, rule.n)


def _case(upper: bool) -> Callable[[cr.AllUppercase | cr.AllLowercase, str], bool]:
    def check(rule: cr.AllUppercase | cr.AllLowercase, text: str) -> bool:
        if not (text.isupper() if upper else text.islower()):
            return False
        if not rule.english:
            return True
        detected = cr.detect_language(text)  # the reference counts an undetectable language as followed
        return detected is None or detected == "en"

    return check


def _quotes(rule: cr.WrapInQuotes, text: str) -> bool:
    body = text.strip()
    return len(body) > 1 and body[0] == '"' and body[-1] == '"'


_CHECKS: dict[str, Callable[[Any, str], bool]] = {
    "include_keywords": _keywords, "keyword_frequency": _keyword_frequency, "forbidden_words": _forbidden,
    "letter_frequency": _letters, "response_language": _language, "sentence_count": _sentences,
    "paragraph_count": _paragraphs, "nth_paragraph_first_word": _nth_first_word, "word_count": _words,
    "placeholders": _placeholders, "postscript": _postscript, "bullet_count": _bullets,
    "constrained_response": _constrained, "highlights": _highlights, "sections": _sections,
    "json_format": _json, "title": _title, "two_responses": _two_responses, "repeat_request": _repeat,
    "ends_with": _ends, "capital_words": _capitals, "all_uppercase": _case(upper=True),
    "all_lowercase": _case(upper=False), "no_commas": lambda rule, text: "," not in text,
    "wrap_in_quotes": _quotes,
    # IFEval has no starts-with instruction: the plain rule is the only reading there is.
    "starts_with": lambda rule, text: rule.check(text),
}


def check(rule: cr.Constraint, text: str) -> bool:
    """Whether `text` follows `rule` as the IFEval reference reads it."""
    return _CHECKS[rule.kind](rule, text)


def loose_variants(text: str) -> list[str]:
    """The reference's eight loose readings: as written, stars removed, first/last/both lines dropped."""
    lines = text.split("\n")
    cut = ["\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [text, text.replace("*", ""), *cut, *(c.replace("*", "") for c in cut)]


def follows(rule: cr.Constraint, text: str) -> tuple[bool, bool]:
    """(strict, loose) verdicts of one instruction on one answer; blank readings never pass."""
    strict = bool(text.strip()) and check(rule, text)
    loose = strict or any(v.strip() and check(rule, v) for v in loose_variants(text)[1:])
    return strict, loose


# ---- IFEval dataset rows -> rules ------------------------------------------------------------

_RULE = TypeAdapter(cr.Constraint)


def _relation(value: str, field: str) -> str:
    if value not in _RELATIONS:
        raise ValueError(f"{field}: expected 'less than' or 'at least', got {value!r}")
    return _RELATIONS[value]


def _letter(letter: str) -> str:
    if len(letter) != 1 or not ("a" <= letter.lower() <= "z"):
        raise ValueError(f"letter: expected one ASCII letter, got {letter!r} (the reference would draw a random one)")
    return letter.lower()


# instruction id -> (required kwargs, builder of the rule's fields from them)
_FROM_IFEVAL: dict[str, tuple[tuple[str, ...], Callable[[dict], dict]]] = {
    "keywords:existence": (("keywords",), lambda k: {"kind": "include_keywords", "keywords": sorted(k["keywords"])}),
    "keywords:frequency": (("keyword", "frequency", "relation"), lambda k: {
        "kind": "keyword_frequency", "keyword": k["keyword"].strip(), "n": k["frequency"],
        "relation": _relation(k["relation"], "relation")}),
    "keywords:forbidden_words": (("forbidden_words",), lambda k: {
        "kind": "forbidden_words", "forbidden": sorted(set(k["forbidden_words"]))}),
    "keywords:letter_frequency": (("letter", "let_frequency", "let_relation"), lambda k: {
        "kind": "letter_frequency", "letter": _letter(k["letter"].strip()), "n": k["let_frequency"],
        "relation": _relation(k["let_relation"], "let_relation")}),
    "language:response_language": (("language",), lambda k: {"kind": "response_language", "language": k["language"]}),
    "length_constraints:number_sentences": (("num_sentences", "relation"), lambda k: {
        "kind": "sentence_count", "n": k["num_sentences"], "relation": _relation(k["relation"], "relation")}),
    "length_constraints:number_paragraphs": (("num_paragraphs",), lambda k: {
        "kind": "paragraph_count", "n": k["num_paragraphs"], "separator": "divider"}),
    "length_constraints:number_words": (("num_words", "relation"), lambda k: {
        "kind": "word_count", "n": k["num_words"], "relation": _relation(k["relation"], "relation")}),
    "length_constraints:nth_paragraph_first_word": (("num_paragraphs", "nth_paragraph", "first_word"), lambda k: {
        "kind": "nth_paragraph_first_word", "num_paragraphs": k["num_paragraphs"],
        "nth_paragraph": k["nth_paragraph"], "first_word": k["first_word"].lower()}),
    "detectable_content:number_placeholders": (("num_placeholders",), lambda k: {
        "kind": "placeholders", "n": k["num_placeholders"]}),
    "detectable_content:postscript": (("postscript_marker",), lambda k: {
        "kind": "postscript", "marker": k["postscript_marker"].strip()}),
    "detectable_format:number_bullet_lists": (("num_bullets",), lambda k: {"kind": "bullet_count", "n": k["num_bullets"]}),
    "detectable_format:constrained_response": ((), lambda k: {"kind": "constrained_response"}),
    "detectable_format:number_highlighted_sections": (("num_highlights",), lambda k: {
        "kind": "highlights", "n": k["num_highlights"]}),
    "detectable_format:multiple_sections": (("section_spliter", "num_sections"), lambda k: {
        "kind": "sections", "marker": k["section_spliter"].strip(), "n": k["num_sections"], "relation": "at_least"}),
    "detectable_format:json_format": ((), lambda k: {"kind": "json_format"}),
    "detectable_format:title": ((), lambda k: {"kind": "title"}),
    "combination:two_responses": ((), lambda k: {"kind": "two_responses"}),
    "combination:repeat_prompt": (("prompt_to_repeat",), lambda k: {
        "kind": "repeat_request", "request": k["prompt_to_repeat"]}),
    "startend:end_checker": (("end_phrase",), lambda k: {"kind": "ends_with", "suffix": k["end_phrase"].strip()}),
    "change_case:capital_word_frequency": (("capital_frequency", "capital_relation"), lambda k: {
        "kind": "capital_words", "n": k["capital_frequency"],
        "relation": _relation(k["capital_relation"], "capital_relation")}),
    "change_case:english_capital": ((), lambda k: {"kind": "all_uppercase", "english": True}),
    "change_case:english_lowercase": ((), lambda k: {"kind": "all_lowercase", "english": True}),
    "punctuation:no_comma": ((), lambda k: {"kind": "no_commas"}),
    "startend:quotation": ((), lambda k: {"kind": "wrap_in_quotes"}),
}
IFEVAL_IDS = tuple(_FROM_IFEVAL)


def from_ifeval(instruction_id: str, kwargs: dict[str, Any]) -> cr.Constraint:
    """The rule an IFEval row's instruction checks; ValueError naming what is wrong otherwise.

    Like the reference, empty values (None, 0, "", []) count as absent; unlike it, an absent
    required value is refused rather than drawn at random, and so is an unknown argument.
    """
    if instruction_id not in _FROM_IFEVAL:
        raise ValueError(f"unknown IFEval instruction id {instruction_id!r}; expected one of {', '.join(IFEVAL_IDS)}")
    required, build = _FROM_IFEVAL[instruction_id]
    given = {k: v for k, v in kwargs.items() if v}
    unknown = sorted(set(given) - set(required))
    missing = [k for k in required if k not in given]
    if unknown or missing:
        raise ValueError(f"{instruction_id}: kwargs {sorted(given)} do not fit; needs {list(required)}"
                         + (f", unknown {unknown}" if unknown else "")
                         + (f", missing or empty {missing} (the reference would draw them at random)" if missing else ""))
    if instruction_id.endswith("nth_paragraph_first_word") and given["nth_paragraph"] > given["num_paragraphs"]:
        raise ValueError(f"{instruction_id}: nth_paragraph {given['nth_paragraph']} exceeds num_paragraphs "
                         f"{given['num_paragraphs']} (the reference would draw nth_paragraph at random)")
    rule = _RULE.validate_python(build(given))
    for pattern in _patterns(rule):
        _regex(pattern, instruction_id)
    return rule


def _patterns(rule: cr.Constraint) -> tuple[str, ...]:
    """The rule's texts that the reference treats as regular expressions."""
    match rule:
        case cr.IncludeKeywords():
            return rule.keywords
        case cr.ForbiddenWords():
            return rule.forbidden
        case cr.KeywordFrequency():
            return (rule.keyword,)
    return ()


def item_from_row(row: Any) -> Item:
    """One IFEval row as a constraints item (id = its key, one user turn = its prompt)."""
    if not isinstance(row, dict) or not {"key", "prompt", "instruction_id_list", "kwargs"} <= set(row):
        raise ValueError("expected an object with key, prompt, instruction_id_list and kwargs")
    ids, kwargs = row["instruction_id_list"], row["kwargs"]
    if not isinstance(ids, list) or not isinstance(kwargs, list) or len(ids) != len(kwargs) or not ids:
        raise ValueError("instruction_id_list and kwargs must be non-empty lists of the same length")
    rules = tuple(from_ifeval(i, k if isinstance(k, dict) else {}) for i, k in zip(ids, kwargs, strict=True))
    return Item(id=str(row["key"]), messages=(Message(role="user", content=row["prompt"]),), constraints=rules)


def items_from_rows(path: Path) -> list[Item]:
    """Every row of an IFEval JSONL file as an item; ValueError naming the file and line otherwise."""
    items = []
    for lineno, row in read_values(path):  # the one JSON-lines reader (core/jsonl.py): split on "\n" only
        try:
            items.append(item_from_row(row))
        except (ValueError, ValidationError) as err:
            raise ValueError(f"{path}:{lineno}: {err}") from err
    if len({item.id for item in items}) != len(items) or not items:
        raise ValueError(f"{path}: keys must be unique and the file non-empty")
    return items


def main(argv: list[str] | None = None) -> int:
    """Convert IFEval rows into a constraints suite's items file (scored with constraint_mode = ifeval)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("rows", type=Path, help="IFEval rows, JSONL (key, prompt, instruction_id_list, kwargs)")
    parser.add_argument("items", type=Path, help="where to write the items JSONL (must not exist)")
    args = parser.parse_args(argv)
    try:
        if args.items.exists():
            raise ValueError(f"{args.items}: already exists (nothing overwritten)")
        items = items_from_rows(args.rows)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_atomic(args.items, "".join(item.model_dump_json() + "\n" for item in items))
    print(json.dumps({"items": str(args.items), "n": len(items)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
