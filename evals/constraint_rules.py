"""Instruction-following rules: one small pydantic model per constraint type, each with `check(text)`.

`check` is the project's plain-meaning reading of the instruction (the default scoring mode); the
IFEval reference reading of the same rule lives in `evals/ifeval.py`, and the strict/loose scoring
that applies either lives in `evals/constraints.py`. Where the plain reading departs from the
reference, the rule's docstring says how and why (each such difference is pinned by a named test
in tests/evals/test_scorer_ifeval.py). Counting conventions are stated next to each helper, so a
rule means the same thing to the prompt writer and the checker.

The rules cover every instruction id registered in IFEval (Zhou et al. 2023, arXiv:2311.07911;
`evals.ifeval.from_ifeval` maps an id and its kwargs to a rule), plus `starts_with`, which IFEval
lacks.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Relation = Literal["exactly", "at_least", "at_most", "less_than"]

# A word is a run of letters/digits, optionally joined by an apostrophe or hyphen ("don't", "x-ray").
_WORD = re.compile(r"\w+(?:['\u2019-]\w+)*")
# A markdown thematic break on a line of its own: three or more *, - or _ (spaces allowed between).
_BREAK_LINE = re.compile(r"[ \t]*([*_-])(?:[ \t]*\1){2,}[ \t]*")
_STAR_BREAK_LINE = re.compile(r"[ \t]*\*(?:[ \t]*\*){2,}[ \t]*")
_BULLET = re.compile(r"[ \t]*[-*+\u2022][ \t]+\S")
# Commas of other scripts are commas too: fullwidth, ideographic, Arabic.
_COMMAS = (",", "\uff0c", "\u3001", "\u060c")
# Sentence splitting: a run of . ! ? (closing quotes/brackets may follow) then whitespace ends a
# sentence, unless the word before the period is a known abbreviation or a one-letter initial.
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(?=\s|$)")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e inc ltd co fig approx dept est no vol u.s a.m p.m cf al".split()
)


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def compare(count: int, relation: Relation, n: int) -> bool:
    if relation == "exactly":
        return count == n
    if relation == "at_least":
        return count >= n
    if relation == "less_than":
        return count < n
    return count <= n


def _abbreviation(word: str) -> bool:
    """A word whose period is not a full stop: a known abbreviation, an initial ("J"), "U.S"."""
    word = word.lower().lstrip("\"'(")
    return (word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha() and word != "i")
            or re.fullmatch(r"(?:[a-z]\.)+[a-z]", word) is not None)


def split_sentences(text: str) -> list[str]:
    """The project's sentence splitter (both modes; IFEval's punkt model cannot be loaded here).

    Line breaks do not end a sentence (punkt's convention); an ellipsis does. "Dr.", "e.g.", "U.S."
    and initials such as "J." do not end one ("I." does). Where punkt differs: its English model
    knows several hundred abbreviations, not only the few in `_ABBREVIATIONS` ("Gen." ends a
    sentence here), and it weighs the next word's case, so it may refuse a break before a lowercase
    word or allow one after an abbreviation that closes a sentence ("... in the U.S. Then").
    """
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        before = text[start:match.start()].split()
        if match.group().rstrip("\"'\u201d\u2019)]") == "." and before and _abbreviation(before[-1]):
            continue
        sentences.append(text[start:match.end()].strip())
        start = match.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


def _separator_line(separator: Literal["blank_line", "divider"]) -> Callable[[str], object]:
    if separator == "divider":
        return _STAR_BREAK_LINE.fullmatch
    return lambda line: not line.strip() or _BREAK_LINE.fullmatch(line)


def paragraphs(text: str, separator: Literal["blank_line", "divider"] = "blank_line") -> list[str]:
    """Paragraphs as a reader sees them: runs of lines between separator lines.

    blank_line: a blank line or a markdown thematic break (`***`, `---`, `___`) on its own line
    separates, so a divider framed by blank lines is one separator, not a paragraph of its own.
    divider: only a line of three or more asterisks separates (IFEval's "separated by ***").
    """
    is_separator = _separator_line(separator)
    chunks, current = [], []
    for line in text.split("\n"):
        if is_separator(line):
            chunks.append("\n".join(current))
            current = []
        else:
            current.append(line)
    chunks.append("\n".join(current))
    return [c.strip() for c in chunks if c.strip()]


def whole_phrase(phrase: str) -> re.Pattern[str]:
    """`phrase` (literal, case-insensitive) not glued to letters or digits on either side.

    Lookarounds rather than `\\b`: `\\b` after "C++" or "e.g." demands a word character next, so
    such a keyword could never match where it stands on its own.
    """
    return re.compile(rf"(?<!\w){re.escape(phrase)}(?!\w)", re.IGNORECASE)


def strip_code_fence(text: str) -> str:
    """A ```json ... ``` fence around the whole answer is formatting, not prose."""
    match = re.fullmatch(r"\s*```[a-zA-Z]*\s*\n(.*?)\n?```\s*", text, flags=re.DOTALL)
    return match.group(1) if match else text


@functools.cache
def _language_factory():
    """langdetect's profiles, loaded once, with a fixed seed (its default draws a new one per call)."""
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.set_seed(0)
    return factory


def detect_language(text: str) -> str | None:
    """ISO 639-1 code langdetect assigns to `text`, or None when the text has no letters to go by."""
    from langdetect.lang_detect_exception import LangDetectException

    detector = _language_factory().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WordCount(_Rule):
    """Plain: "don't" and "x-ray" are one word each (IFEval's `\\w+` counts two)."""

    kind: Literal["word_count"] = Field(description="Number of words relative to n.")
    relation: Relation = Field(description="exactly / at_least / at_most / less_than.")
    n: int = Field(ge=0, description="Word count bound.")

    def check(self, text: str) -> bool:
        return compare(len(words(text)), self.relation, self.n)


class SentenceCount(_Rule):
    """Both modes count with `split_sentences`; IFEval proper uses punkt (see that function)."""

    kind: Literal["sentence_count"] = Field(description="Number of sentences relative to n.")
    relation: Relation = Field(description="exactly / at_least / at_most / less_than.")
    n: int = Field(ge=0, description="Sentence count bound.")

    def check(self, text: str) -> bool:
        return compare(len(split_sentences(text)), self.relation, self.n)


class ParagraphCount(_Rule):
    """Plain: a `***` line must stand on its own to divide (IFEval splits at `***` anywhere, even
    inside `***bold italic***`), and an empty paragraph between two dividers is not counted
    (IFEval fails the whole answer)."""

    kind: Literal["paragraph_count"] = Field(description="Exactly n paragraphs.")
    n: int = Field(ge=1, description="Required paragraph count.")
    separator: Literal["blank_line", "divider"] = Field(
        "blank_line", description="What separates paragraphs: blank lines, or `***` divider lines (IFEval's).")

    def check(self, text: str) -> bool:
        return len(paragraphs(text, self.separator)) == self.n


class NthParagraphFirstWord(_Rule):
    """Plain: paragraphs split at blank lines (also "\\n \\n"), and the first word is read past
    markdown and quotes and ends at any non-word character ("**Summer**:" starts with "summer";
    IFEval reads "**summer**:")."""

    kind: Literal["nth_paragraph_first_word"] = Field(
        description="Exactly num_paragraphs paragraphs (blank-line separated), the nth opening with first_word.")
    num_paragraphs: int = Field(ge=1, description="Required paragraph count.")
    nth_paragraph: int = Field(ge=1, description="Which paragraph (1-based) must open with first_word.")
    first_word: str = Field(min_length=1, description="The required first word (case-insensitive).")

    def check(self, text: str) -> bool:
        paras = paragraphs(text)
        if len(paras) != self.num_paragraphs or self.nth_paragraph > len(paras):
            return False
        first = _WORD.search(paras[self.nth_paragraph - 1])
        return first is not None and first.group().lower() == self.first_word.lower()


class BulletCount(_Rule):
    """Plain: a bullet is `-`, `*`, `+` or `•` then a space; IFEval also counts any line opening with
    `-` ("-5 degrees", a `---` rule) or with `*` then a non-star ("*emphasis* ...")."""

    kind: Literal["bullet_count"] = Field(description="Exactly n markdown bullet points (-, *, +, •).")
    n: int = Field(ge=0, description="Required bullet count.")

    def check(self, text: str) -> bool:
        lines = text.split("\n")
        return sum(bool(_BULLET.match(ln)) and not _BREAK_LINE.fullmatch(ln) for ln in lines) == self.n


class IncludeKeywords(_Rule):
    """Plain: each keyword as a whole word or phrase, literally ("cat" is not in "category"); IFEval
    searches each as a regular expression anywhere ("e.g." also matches "eggs")."""

    kind: Literal["include_keywords"] = Field(description="Every keyword appears (case-insensitive).")
    keywords: tuple[str, ...] = Field(min_length=1, description="Keywords that must appear.")

    def check(self, text: str) -> bool:
        return all(whole_phrase(k).search(text) for k in self.keywords)


class ForbiddenWords(_Rule):
    """Plain: each word literally, not glued to other letters; IFEval wraps it in `\\b`, so "e.g."
    standing before a space is never found, and "C++" (a regex there) is found in any "C"."""

    kind: Literal["forbidden_words"] = Field(description="No forbidden word appears as a whole word.")
    forbidden: tuple[str, ...] = Field(min_length=1, description="Words that must not appear.")

    def check(self, text: str) -> bool:
        return not any(whole_phrase(w).search(text) for w in self.forbidden)


class KeywordFrequency(_Rule):
    """Plain: whole-word occurrences ("go" is not in "gone"); IFEval counts regex matches anywhere."""

    kind: Literal["keyword_frequency"] = Field(description="A keyword's whole-word count relative to n.")
    keyword: str = Field(min_length=1, description="The keyword counted (case-insensitive).")
    relation: Relation = Field(description="exactly / at_least / at_most / less_than.")
    n: int = Field(ge=0, description="Count bound.")

    def check(self, text: str) -> bool:
        return compare(len(whole_phrase(self.keyword).findall(text)), self.relation, self.n)


class LetterFrequency(_Rule):
    kind: Literal["letter_frequency"] = Field(description="A letter's count (case-insensitive) relative to n.")
    letter: str = Field(min_length=1, max_length=1, description="The letter counted.")
    relation: Relation = Field(description="exactly / at_least / at_most / less_than.")
    n: int = Field(ge=0, description="Count bound.")

    def check(self, text: str) -> bool:
        return compare(text.lower().count(self.letter.lower()), self.relation, self.n)


class ResponseLanguage(_Rule):
    """Plain: an answer langdetect cannot place (no letters) fails; IFEval counts it as followed."""

    kind: Literal["response_language"] = Field(description="The whole answer is in this language (langdetect).")
    language: str = Field(pattern=r"^[a-z]{2}(-[a-z]{2})?$", description="ISO 639-1 code, e.g. en, fr, zh-cn.")

    def check(self, text: str) -> bool:
        return detect_language(text) == self.language


class StartsWith(_Rule):
    kind: Literal["starts_with"] = Field(description="The answer begins with this exact text.")
    prefix: str = Field(min_length=1, description="Required opening text.")

    def check(self, text: str) -> bool:
        return text.strip().startswith(self.prefix)


class EndsWith(_Rule):
    """Plain: the phrase is exact, case included ("Any other questions?" is not "any other
    questions?"); IFEval compares lowercased. Both look past closing double quotes."""

    kind: Literal["ends_with"] = Field(description="The answer ends with this exact text.")
    suffix: str = Field(min_length=1, description="Required closing text.")

    def check(self, text: str) -> bool:
        return text.strip().strip('"').endswith(self.suffix.strip())


class AllLowercase(_Rule):
    kind: Literal["all_lowercase"] = Field(description="No uppercase letters, at least one letter.")
    english: bool = Field(False, description="Also required to be English (langdetect), as IFEval asks.")

    def check(self, text: str) -> bool:
        return text.islower() and (not self.english or detect_language(text) == "en")


class AllUppercase(_Rule):
    kind: Literal["all_uppercase"] = Field(description="No lowercase letters, at least one letter.")
    english: bool = Field(False, description="Also required to be English (langdetect), as IFEval asks.")

    def check(self, text: str) -> bool:
        return text.isupper() and (not self.english or detect_language(text) == "en")


class CapitalWords(_Rule):
    """Plain: an all-caps word has two or more letters, so "I" and "A" are ordinary words; IFEval
    counts every upper-case token of nltk's tokenizer, "I" and the two halves of "DON'T" included."""

    kind: Literal["capital_words"] = Field(description="Number of ALL-CAPS words relative to n.")
    relation: Relation = Field(description="exactly / at_least / at_most / less_than.")
    n: int = Field(ge=0, description="Count bound.")

    def check(self, text: str) -> bool:
        caps = [w for w in words(text) if w.isupper() and sum(c.isalpha() for c in w) >= 2]
        return compare(len(caps), self.relation, self.n)


class JsonFormat(_Rule):
    """Plain: a fence may carry any language tag (```python); IFEval strips only ``` and ```json."""

    kind: Literal["json_format"] = Field(description="The whole answer is one JSON value (a code fence is allowed).")

    def check(self, text: str) -> bool:
        try:
            json.loads(strip_code_fence(text).strip())
        except json.JSONDecodeError:
            return False
        return True


class Title(_Rule):
    kind: Literal["title"] = Field(description="A title in double angular brackets, e.g. <<my title>>.")

    def check(self, text: str) -> bool:
        return any(t.strip() for t in re.findall(r"<<([^<>\n]+)>>", text))


class NoCommas(_Rule):
    """Plain: fullwidth, ideographic and Arabic commas are commas too; IFEval looks for "," only."""

    kind: Literal["no_commas"] = Field(description="No comma anywhere in the answer.")

    def check(self, text: str) -> bool:
        return not any(c in text for c in _COMMAS)


class Placeholders(_Rule):
    """Plain: `[]` and `[ ]` (a checkbox) are not placeholders; IFEval counts any `[...]`."""

    kind: Literal["placeholders"] = Field(description="At least n square-bracket placeholders like [name].")
    n: int = Field(ge=1, description="Minimum placeholder count.")

    def check(self, text: str) -> bool:
        return len(re.findall(r"\[[^\[\]\n]*[^\[\]\s][^\[\]\n]*\]", text)) >= self.n


class Sections(_Rule):
    """Plain: a section header opens a line (markdown `#`/`*` may decorate it); IFEval splits at
    the marker and a number anywhere, so "see Section 2 above" opens a section there."""

    kind: Literal["sections"] = Field(description="n sections, each opened by '<marker> <number>'.")
    n: int = Field(ge=1, description="Section count bound.")
    marker: str = Field("SECTION", min_length=1, description="Section header word, e.g. SECTION or PART.")
    relation: Relation = Field("exactly", description="exactly / at_least (IFEval's) / at_most / less_than.")

    def check(self, text: str) -> bool:
        headers = re.findall(rf"^[ \t#*_]*{re.escape(self.marker)}[ \t]+\d+\b", text, re.MULTILINE)
        return compare(len(headers), self.relation, self.n)


class Highlights(_Rule):
    """Plain: a *span* or **span** whose text touches both stars (markdown emphasis), so "2 * 3 * 4"
    and a bullet's star are not highlights; IFEval counts any non-blank text between two stars."""

    kind: Literal["highlights"] = Field(description="At least n *highlighted* (or **bold**) spans in markdown.")
    n: int = Field(ge=1, description="Minimum highlighted span count.")

    def check(self, text: str) -> bool:
        spans = re.findall(r"(\*\*|\*)(?=[^\s*])([^*\n]*[^\s*])\1", text)
        return len(spans) >= self.n


class Postscript(_Rule):
    """Plain: the marker opens a line (emphasis allowed, case ignored); IFEval finds "p.s." anywhere."""

    kind: Literal["postscript"] = Field(description="A postscript starting with the marker (default P.S.).")
    marker: str = Field("P.S.", min_length=1, description="Postscript opener.")

    def check(self, text: str) -> bool:
        return re.search(rf"^[ \t>*_]*{re.escape(self.marker)}", text, re.MULTILINE | re.IGNORECASE) is not None


class WrapInQuotes(_Rule):
    """Plain: typographic quotes “...” wrap as well as straight ones; IFEval takes only '"'."""

    kind: Literal["wrap_in_quotes"] = Field(description="The whole answer is wrapped in double quotes.")

    def check(self, text: str) -> bool:
        body = text.strip()
        return len(body) >= 2 and (body[0], body[-1]) in {('"', '"'), ("\u201c", "\u201d")}


class RepeatRequest(_Rule):
    """Plain: runs of whitespace compare equal (a re-wrapped line is still the request verbatim)."""

    kind: Literal["repeat_request"] = Field(description="The answer first repeats the request verbatim.")
    request: str = Field(min_length=1, description="The request text that must open the answer.")

    def check(self, text: str) -> bool:
        def norm(s: str) -> str:
            return " ".join(s.split()).lower()

        return norm(text).startswith(norm(self.request))


class ConstrainedResponse(_Rule):
    """Plain: exactly one of the options appears (case ignored); IFEval passes an answer that
    contains several ("My answer is yes. My answer is no.")."""

    kind: Literal["constrained_response"] = Field(description="The answer gives one of the listed options.")
    options: tuple[str, ...] = Field(
        ("My answer is yes.", "My answer is no.", "My answer is maybe."), min_length=1,
        description="The allowed answers (IFEval's three by default).")

    def check(self, text: str) -> bool:
        low = text.lower()
        return sum(opt.lower() in low for opt in self.options) == 1


class TwoResponses(_Rule):
    """Plain: the separator is exactly six stars (a run of seven is not it), and two responses that
    differ only in spacing are the same response."""

    kind: Literal["two_responses"] = Field(description="Two different responses separated by ******.")

    def check(self, text: str) -> bool:
        parts = re.split(r"(?<!\*)\*{6}(?!\*)", text)
        if any(not p.strip() for p in parts[1:-1]):
            return False
        answers = [" ".join(p.split()) for p in parts if p.strip()]
        return len(answers) == 2 and answers[0] != answers[1]


Constraint = Annotated[
    WordCount | SentenceCount | ParagraphCount | NthParagraphFirstWord | BulletCount | IncludeKeywords
    | ForbiddenWords | KeywordFrequency | LetterFrequency | ResponseLanguage | StartsWith | EndsWith
    | AllLowercase | AllUppercase | CapitalWords | JsonFormat | Title | NoCommas | Placeholders | Sections
    | Highlights | Postscript | WrapInQuotes | RepeatRequest | ConstrainedResponse | TwoResponses,
    Field(discriminator="kind"),
]
