"""Instruction-following rules: one small pydantic model per constraint type, each with `check(text)`.

Written here from the rule descriptions (word/sentence/paragraph counts, keywords, case, JSON, ...);
the strict/loose scoring that applies them lives in `evals/constraints.py`. Counting conventions
are stated next to each helper so a rule means the same thing to the prompt writer and the checker.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Relation = Literal["exactly", "at_least", "at_most"]

# A word is a run of letters/digits, optionally joined by an apostrophe or hyphen ("don't", "x-ray").
_WORD = re.compile(r"\w+(?:['\u2019-]\w+)*")
# A sentence ends at ., ! or ? (runs like "?!" count once, closing quotes/brackets may follow) and
# whitespace; abbreviations such as "Dr." are over-counted, a convention prompt writers must know.
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
_BULLET = re.compile(r"^\s*[-*+\u2022]\s+\S", re.MULTILINE)


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def compare(count: int, relation: Relation, n: int) -> bool:
    if relation == "exactly":
        return count == n
    if relation == "at_least":
        return count >= n
    return count <= n


def paragraphs(text: str) -> list[str]:
    """Paragraphs are separated by one or more blank lines (or a markdown `***` divider line)."""
    parts = re.split(r"\n\s*\n|\n\s*\*\*\*\s*\n", text.strip())
    return [p for p in parts if p.strip()]


def strip_code_fence(text: str) -> str:
    """A ```json ... ``` fence around the whole answer is formatting, not prose."""
    match = re.fullmatch(r"\s*```[a-zA-Z]*\s*\n(.*?)\n?```\s*", text, flags=re.DOTALL)
    return match.group(1) if match else text


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WordCount(_Rule):
    kind: Literal["word_count"] = Field(description="Number of words relative to n.")
    relation: Relation = Field(description="exactly / at_least / at_most.")
    n: int = Field(ge=0, description="Word count bound.")

    def check(self, text: str) -> bool:
        return compare(len(words(text)), self.relation, self.n)


class SentenceCount(_Rule):
    kind: Literal["sentence_count"] = Field(description="Number of sentences relative to n.")
    relation: Relation = Field(description="exactly / at_least / at_most.")
    n: int = Field(ge=0, description="Sentence count bound.")

    def check(self, text: str) -> bool:
        count = len([s for s in _SENTENCE_SPLIT.split(text.strip()) if s.strip()])
        return compare(count, self.relation, self.n)


class ParagraphCount(_Rule):
    kind: Literal["paragraph_count"] = Field(description="Exactly n paragraphs separated by blank lines.")
    n: int = Field(ge=1, description="Required paragraph count.")

    def check(self, text: str) -> bool:
        return len(paragraphs(text)) == self.n


class BulletCount(_Rule):
    kind: Literal["bullet_count"] = Field(description="Exactly n markdown bullet points (-, *, +).")
    n: int = Field(ge=0, description="Required bullet count.")

    def check(self, text: str) -> bool:
        return len(_BULLET.findall(text)) == self.n


class IncludeKeywords(_Rule):
    kind: Literal["include_keywords"] = Field(description="Every keyword appears (case-insensitive).")
    keywords: tuple[str, ...] = Field(min_length=1, description="Keywords that must appear.")

    def check(self, text: str) -> bool:
        low = text.lower()
        return all(k.lower() in low for k in self.keywords)


class ForbiddenWords(_Rule):
    kind: Literal["forbidden_words"] = Field(description="No forbidden word appears as a whole word.")
    forbidden: tuple[str, ...] = Field(min_length=1, description="Words that must not appear.")

    def check(self, text: str) -> bool:
        return not any(re.search(rf"\b{re.escape(w)}\b", text, re.IGNORECASE) for w in self.forbidden)


class KeywordFrequency(_Rule):
    kind: Literal["keyword_frequency"] = Field(description="A keyword's whole-word count relative to n.")
    keyword: str = Field(min_length=1, description="The keyword counted (case-insensitive).")
    relation: Relation = Field(description="exactly / at_least / at_most.")
    n: int = Field(ge=0, description="Count bound.")

    def check(self, text: str) -> bool:
        count = len(re.findall(rf"\b{re.escape(self.keyword)}\b", text, re.IGNORECASE))
        return compare(count, self.relation, self.n)


class LetterFrequency(_Rule):
    kind: Literal["letter_frequency"] = Field(description="A letter's count (case-insensitive) relative to n.")
    letter: str = Field(min_length=1, max_length=1, description="The letter counted.")
    relation: Relation = Field(description="exactly / at_least / at_most.")
    n: int = Field(ge=0, description="Count bound.")

    def check(self, text: str) -> bool:
        return compare(text.lower().count(self.letter.lower()), self.relation, self.n)


class StartsWith(_Rule):
    kind: Literal["starts_with"] = Field(description="The answer begins with this exact text.")
    prefix: str = Field(min_length=1, description="Required opening text.")

    def check(self, text: str) -> bool:
        return text.strip().startswith(self.prefix)


class EndsWith(_Rule):
    kind: Literal["ends_with"] = Field(description="The answer ends with this exact text.")
    suffix: str = Field(min_length=1, description="Required closing text.")

    def check(self, text: str) -> bool:
        return text.strip().endswith(self.suffix)


class AllLowercase(_Rule):
    kind: Literal["all_lowercase"] = Field(description="No uppercase letters anywhere.")

    def check(self, text: str) -> bool:
        return bool(text.strip()) and text == text.lower()


class AllUppercase(_Rule):
    kind: Literal["all_uppercase"] = Field(description="No lowercase letters anywhere.")

    def check(self, text: str) -> bool:
        return bool(text.strip()) and text == text.upper()


class CapitalWords(_Rule):
    kind: Literal["capital_words"] = Field(description="Number of ALL-CAPS words relative to n.")
    relation: Relation = Field(description="exactly / at_least / at_most.")
    n: int = Field(ge=0, description="Count bound.")

    def check(self, text: str) -> bool:
        caps = [w for w in words(text) if w.isupper()]
        return compare(len(caps), self.relation, self.n)


class JsonFormat(_Rule):
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
    kind: Literal["no_commas"] = Field(description="No comma anywhere in the answer.")

    def check(self, text: str) -> bool:
        return "," not in text


class Placeholders(_Rule):
    kind: Literal["placeholders"] = Field(description="At least n square-bracket placeholders like [name].")
    n: int = Field(ge=1, description="Minimum placeholder count.")

    def check(self, text: str) -> bool:
        return len(re.findall(r"\[[^\[\]\n]+\]", text)) >= self.n


class Sections(_Rule):
    kind: Literal["sections"] = Field(description="Exactly n sections, each opened by '<marker> <number>'.")
    n: int = Field(ge=1, description="Required section count.")
    marker: str = Field("SECTION", min_length=1, description="Section header word, e.g. SECTION or PART.")

    def check(self, text: str) -> bool:
        headers = re.findall(rf"^\s*{re.escape(self.marker)}\s+\d+", text, re.MULTILINE)
        return len(headers) == self.n


class Highlights(_Rule):
    kind: Literal["highlights"] = Field(description="At least n *highlighted* spans in markdown.")
    n: int = Field(ge=1, description="Minimum highlighted span count.")

    def check(self, text: str) -> bool:
        spans = re.findall(r"(?<!\*)\*([^*\n]+)\*(?!\*)", text)
        return len([s for s in spans if s.strip()]) >= self.n


class Postscript(_Rule):
    kind: Literal["postscript"] = Field(description="A postscript starting with the marker (default P.S.).")
    marker: str = Field("P.S.", min_length=1, description="Postscript opener.")

    def check(self, text: str) -> bool:
        return re.search(rf"^\s*{re.escape(self.marker)}", text, re.MULTILINE) is not None


class WrapInQuotes(_Rule):
    kind: Literal["wrap_in_quotes"] = Field(description="The whole answer is wrapped in double quotes.")

    def check(self, text: str) -> bool:
        body = text.strip()
        return len(body) >= 2 and body[0] == '"' and body[-1] == '"'


class RepeatRequest(_Rule):
    kind: Literal["repeat_request"] = Field(description="The answer first repeats the request verbatim.")
    request: str = Field(min_length=1, description="The request text that must open the answer.")

    def check(self, text: str) -> bool:
        return text.strip().lower().startswith(self.request.strip().lower())


Constraint = Annotated[
    WordCount | SentenceCount | ParagraphCount | BulletCount | IncludeKeywords | ForbiddenWords
    | KeywordFrequency | LetterFrequency | StartsWith | EndsWith | AllLowercase | AllUppercase
    | CapitalWords | JsonFormat | Title | NoCommas | Placeholders | Sections | Highlights | Postscript
    | WrapInQuotes | RepeatRequest,
    Field(discriminator="kind"),
]
