"""Build tests/evals/corpus/ifeval_cases.jsonl: hand-written IFEval edge cases with lm-eval's verdicts.

Each case is an IFEval row (instruction ids, their kwargs) plus a response; the reference verdicts
(strict and loose, per instruction) are lm-eval 0.4.13's, computed here with the same patches the
test uses (punkt replaced by the project's sentence splitter, langdetect seeded). Re-run after
editing the cases:

    .venv/bin/python tests/evals/corpus/build_ifeval_cases.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent.parent))

LESS, LEAST = "less than", "at least"


def i(instruction_id: str, **kwargs) -> dict:
    return {"id": instruction_id, "kwargs": kwargs}


def counted(instruction_id: str, responses: list[str], n_key: str, rel_key: str | None, ns: tuple[int, ...]):
    """Each response against each bound (and each relation, when the instruction has one)."""
    out = []
    for resp in responses:
        for n in ns:
            for rel in ((LESS, LEAST) if rel_key else (None,)):
                kwargs = {n_key: n} | ({rel_key: rel} if rel_key else {})
                out.append(([i(instruction_id, **kwargs)], resp))
    return out


def keyword_cases():
    cases = []
    for kws, resp in [
        (["cat"], "A category of things."), (["cat"], "The CAT sat."), (["cat", "dog"], "cat only"),
        (["e.g."], "I like eggs."), (["e.g."], "Fruit, e.g. apples."), (["C#"], "I write C# daily."),
        (["C++"], "I like C."), (["C++"], "I like Python."),
        (["new york"], "I love New  York."), (["new york"], "I love New York."), (["ai"], "Said plainly."),
        (["ai"], "AI is here."), (["hello"], "Sure, here it is:\nhello world"), (["x"], ""),
        (["python", "code"], "**Python** code"), (["über"], "Das ist ÜBER gut."),
    ]:
        cases.append(([i("keywords:existence", keywords=kws)], resp))
    for kw, resp in [("go", "go gone going go"), ("go", "Go. GO! go?"), ("the", "The theme of the thesis."),
                     ("e.g.", "e.g. eggs e.g."), ("is", "This is it.\nIs it?"), ("cat", "")]:
        for n in (1, 2, 3, 4):
            for rel in (LESS, LEAST):
                cases.append(([i("keywords:frequency", keyword=kw, frequency=n, relation=rel)], resp))
    for words, resp in [
        (["bad"], "badge is fine"), (["bad"], "This is BAD."), (["bad"], "bad-ass"), (["e.g."], "e.g. this"),
        (["e.g."], "eggs"), (["can't"], "I can't."), (["can't"], "I cant."), (["hello", "world"], "Hello there"),
        (["foo"], "foo_bar"), (["C++"], "I write C++ daily."), (["C++"], "I write Rust."), (["foo"], "**foo**"), (["foo"], "Sure:\nno words here\nfoo"), (["naïve"], "So naïve!"),
    ]:
        cases.append(([i("keywords:forbidden_words", forbidden_words=words)], resp))
    for letter, resp in [("a", "banana"), ("A", "AAA aaa"), ("z", "zigzag"), ("e", "Éléphant et élève"),
                         ("l", "*l*l*l"), ("s", "")]:
        for n in (2, 3, 6):
            for rel in (LESS, LEAST):
                cases.append(([i("keywords:letter_frequency", letter=letter, let_frequency=n, let_relation=rel)], resp))
    return cases


def language_cases():
    cases = []
    for lang, resp in [
        ("en", "This is a plain English sentence about the weather today."),
        ("fr", "Ceci est une phrase en français sur le temps qu'il fait."),
        ("de", "Das ist ein deutscher Satz über das Wetter von heute."),
        ("es", "Esta es una frase en español sobre el tiempo de hoy."),
        ("fr", "This is English, not French, whatever the request said."),
        ("en", "12345 67890"), ("de", "!!! ??? ..."), ("ja", "これは日本語の文です。"),
        ("hi", "यह हिंदी में एक वाक्य है।"), ("ru", "Это предложение на русском языке о погоде."),
        ("it", "Questa è una frase in italiano sul tempo di oggi."),
        ("pt", "Esta é uma frase em português sobre o tempo de hoje."),
        ("en", "Sure:\nCeci est une phrase en français sur le temps qu'il fait."),
    ]:
        cases.append(([i("language:response_language", language=lang)], resp))
    return cases


SENTENCE_TEXTS = [
    "One. Two. Three.", "Dr. Smith arrived. He sat down.", "Is it? Yes! Fine.", "Wait... what? OK.",
    "It costs $3.50 today. Cheap.", "No punctuation at all", "Line one\nLine two\nLine three.",
    "He said \"Go.\" She left.", "The U.S. economy grew. Markets rose.", "e.g. this one. And that.",
    "First sentence.Second sentence.", "",
]


def length_cases():
    cases = counted("length_constraints:number_sentences", SENTENCE_TEXTS, "num_sentences", "relation", (2, 3))
    words = ["one two three", "don't stop", "x-ray vision", "Hello, world! 42 times.", "snake_case word",
             "   ", "naïve café", "a\nb\nc\nd", "**bold** words here"]
    cases += counted("length_constraints:number_words", words, "num_words", "relation", (2, 3, 4))
    paragraphs = [
        "p1\n***\np2", "p1\n\n***\n\np2", "p1 *** p2 *** p3", "***\np1\n***\np2\n***", "p1\n***\n***\np2",
        "p1\n\np2\n\np3", "***bold italic*** text\n***\nmore", "single paragraph", "p1\n* * *\np2",
        "Intro line\np1\n***\np2", "p1\n****\np2",
    ]
    cases += counted("length_constraints:number_paragraphs", paragraphs, "num_paragraphs", None, (1, 2, 3))
    for text, n, nth, word in [
        ("Summer is here.\n\nWinter follows.", 2, 2, "winter"),
        ("Summer is here.\n\nWinter follows.", 2, 1, "summer"),
        ("Summer is here.\n\n\"Winter\" follows.", 2, 2, "winter"),
        ("**Summer** is here.\n\nWinter follows.", 2, 1, "summer"),
        ("Summer: here.\n\nWinter follows.", 2, 1, "summer"),
        ("Summer, here.\n\nWinter follows.", 2, 1, "summer"),
        ("a\n\n\n\nb", 2, 2, "b"), ("a\n \nb", 2, 2, "b"), ("a\n\n\n\nb", 2, 1, "a"),
        ("one\n\ntwo\n\nthree", 3, 3, "three"), ("one\n\ntwo\n\nthree", 2, 2, "two"),
        ("one\n\ntwo", 3, 3, "two"), ("\n\none\n\ntwo", 2, 2, "two"), ("I'm here.\n\nYes.", 2, 1, "i"),
        ("'Quote' first.\n\nYes.", 2, 1, "quote"), ("Sure!\nOne.\n\nTwo.", 2, 1, "one"),
    ]:
        cases.append(([i("length_constraints:nth_paragraph_first_word", num_paragraphs=n, nth_paragraph=nth,
                         first_word=word)], text))
    return cases


def content_cases():
    texts = ["Dear [name], at [address].", "Nothing here.", "Empty [] and [ ] boxes.", "[a][b][c]",
             "A [multi\nline] one.", "See [link](http://x.org) and [name]."]
    cases = counted("detectable_content:number_placeholders", texts, "num_placeholders", None, (1, 2, 3))
    for marker, text in [
        ("P.S.", "Body.\nP.S. see you"), ("P.S.", "Body. PS see you"), ("P.S.", "Body.\np. s. later"),
        ("P.S.", "Body.\n**P.S.** bold"), ("P.S.", "I help.s. all"), ("P.P.S", "Body.\nP.P.S more"),
        ("P.P.S", "Body.\nP.S. only"), ("P.S.", "Sure.\nBody\nP.S. last line"), ("Note:", "Body.\nNote: x"),
        ("Note:", "Body.\nnote: lower"), ("P.S.", ""),
    ]:
        cases.append(([i("detectable_content:postscript", postscript_marker=marker)], text))
    return cases


def format_cases():
    bullets = ["* a\n* b", "- a\n- b\n- c", "* a\n- b", "*emphasis* first\n* a", "-5 degrees\n- a",
               "---\n- a", "+ a\n+ b", "1. a\n2. b", "  * nested\n* top", "**bold** line\n* a",
               "Intro:\n* a\n* b\nThanks!"]
    cases = counted("detectable_format:number_bullet_lists", bullets, "num_bullets", None, (1, 2, 3))
    for text in ["My answer is yes.", "My answer is no. My answer is yes.", "my answer is yes.",
                 "I think: My answer is maybe. Because.", "My answer is yes", "Sure\nMy answer is no.", "Yes."]:
        cases.append(([i("detectable_format:constrained_response")], text))
    highlights = ["*one* and *two*", "**bold** only", "2 * 3 * 4", "* bullet\n* list", "*a*\n*b*\n*c*",
                  "***both***", "** **", "*one*, **two**, *three*", "*unclosed and *closed*"]
    cases += counted("detectable_format:number_highlighted_sections", highlights, "num_highlights", None, (1, 2, 3))
    for spliter, text, n in [
        ("SECTION", "SECTION 1\na\nSECTION 2\nb", 2), ("SECTION", "SECTION 1\na", 2),
        ("Section", "Section 1 a Section 2 b Section 3 c", 3), ("Section", "see Section 2 above", 1),
        ("SECTION", "## SECTION 1\na\n## SECTION 2\nb", 2), ("SECTION", "Section 1\na\nSection 2\nb", 2),
        ("PART", "PART 1: x\nPART 2: y\nPART 3: z", 2), ("SECTION", "SECTION X\nSECTION Y", 1),
        ("SECTION", "SECTION1\nSECTION2", 2),
    ]:
        cases.append(([i("detectable_format:multiple_sections", section_spliter=spliter, num_sections=n)], text))
    for text in ['{"a": 1}', '```json\n{"a": 1}\n```', '```\n[1, 2]\n```', '```python\n{"a": 1}\n```',
                 "{'a': 1}", '{"answer": 42}\nHope this helps!', 'Here:\n{"a": 1}', '```JSON\n{"a": 1}```',
                 "42", '"just a string"', ""]:
        cases.append(([i("detectable_format:json_format")], text))
    for text in ["<<My Poem>>\nroses", "My Poem\nroses", "<< >>\ntext", "<<a>> and <<b>>", "<<<>>>",
                 "<<multi\nline>>", "**<<Bold Title>>**"]:
        cases.append(([i("detectable_format:title")], text))
    return cases


def combination_cases():
    cases = []
    for text in ["Answer one.\n******\nAnswer two.", "Same.\n******\nSame.", "Same.\n******\n Same. ",
                 "A\n*******\nB", "A ****** ****** B", "Only one answer.", "A\n******\nB\n******\nC",
                 "******\nA\n******\nB", "A ******B", "Intro\n\nA\n******\nB"]:
        cases.append(([i("combination:two_responses")], text))
    for prompt, text in [
        ("Write a poem.", "Write a poem. Roses are red."), ("Write a poem.", "write a poem. roses"),
        ("Write a poem.", "Sure! Write a poem. Roses."), ("Write a\npoem.", "Write a poem. Roses."),
        ("Write a poem.", "  Write a poem.  Roses."), ("Write a poem.", "Write a poem"),
    ]:
        cases.append(([i("combination:repeat_prompt", prompt_to_repeat=prompt)], text))
    for phrase, text in [
        ("Any other questions?", "Done. Any other questions?"), ("Any other questions?", "Done. any other questions?"),
        ("Any other questions?", '"Done. Any other questions?"'), ("Any other questions?", "Any other questions? Bye."),
        ("Any other questions?", "Done. Any other questions?\n"), ("Is there anything else I can help with?",
                                                                   "Done.\nIs there anything else I can help with?\n*"),
        ("Bye.", "Done. **Bye.**"),
    ]:
        cases.append(([i("startend:end_checker", end_phrase=phrase)], text))
    for text in ['"quoted answer"', "unquoted", "\u201ccurly quotes\u201d", '"', ' "padded" ', '"a" and "b"']:
        cases.append(([i("startend:quotation")], text))
    return cases


CAPS_TEXTS = ["VERY IMPORTANT note", "I am here", "DON'T STOP", "I CANNOT. YES.", "HELLO,WORLD", "U.S.A. rocks",
              "ALL-CAPS word", "Mixed CaSe", "", "NASA and ESA", "DON'T. AND STOP."]
CASE_TEXTS = ["ALL UPPER ENGLISH TEXT HERE", "all lower english text here", "MOSTLY Upper", "123 456",
              "TOUT EN MAJUSCULES EN FRANÇAIS ICI", "tout en minuscules en français ici", "THIS IS IT 123.",
              "this is it 123.", "Sure!\nTHIS IS THE ANSWER IN CAPITALS", "**ALL BOLD UPPER TEXT**"]


def case_cases():
    cases = counted("change_case:capital_word_frequency", CAPS_TEXTS, "capital_frequency", "capital_relation", (1, 2, 3))
    for text in CASE_TEXTS:
        cases.append(([i("change_case:english_capital")], text))
        cases.append(([i("change_case:english_lowercase")], text))
    for text in ["no commas here", "one, two", "full\uff0cwidth", "\u3001ideographic", "Sure, here:\nno commas",
                 "no commas\nbut, at the end"]:
        cases.append(([i("punctuation:no_comma")], text))
    return cases


def multi_cases():
    return [
        ([i("punctuation:no_comma"), i("change_case:english_lowercase")], "all lowercase and no commas here"),
        ([i("punctuation:no_comma"), i("startend:quotation")], '"a, b"'),
        ([i("detectable_format:title"), i("detectable_content:postscript", postscript_marker="P.S.")],
         "<<Title>>\nBody text.\nP.S. bye"),
        ([i("length_constraints:number_words", num_words=5, relation=LESS), i("keywords:existence", keywords=["hi"])],
         "Sure:\nhi there\nThanks!"),
        ([i("startend:end_checker", end_phrase="Bye."), i("startend:quotation")], '"Hello. Bye."'),
        ([i("detectable_format:json_format"), i("keywords:forbidden_words", forbidden_words=["error"])],
         '{"status": "ok"}'),
        ([i("punctuation:no_comma"), i("length_constraints:number_sentences", num_sentences=2, relation=LEAST)],
         "   "),
    ]


def loose_cases():
    """Answers that a preamble line, a closing line or markdown stars push across the line."""
    sure, bye = "Sure, here you go:\n", "\nHope this helps!"
    return [
        ([i("detectable_format:json_format")], sure + '{"a": 1}'),
        ([i("detectable_format:json_format")], '```json\n{"a": 1}\n```' + bye),
        ([i("detectable_format:json_format")], sure + '{"a": 1}' + bye),
        ([i("detectable_format:json_format")], sure + '{"a": 1,\n "b": 2}' + bye),
        ([i("startend:quotation")], sure + '"quoted"'),
        ([i("startend:quotation")], '"quoted"' + bye),
        ([i("startend:quotation")], '**"quoted"**'),
        ([i("startend:end_checker", end_phrase="Any other questions?")], "Text. Any other questions?" + bye),
        ([i("startend:end_checker", end_phrase="Any other questions?")], "Text. **Any other questions?**"),
        ([i("combination:repeat_prompt", prompt_to_repeat="Tell me a joke.")], sure + "Tell me a joke. Why?"),
        ([i("combination:repeat_prompt", prompt_to_repeat="Tell me a joke.")], "**Tell me a joke.** Why?"),
        ([i("punctuation:no_comma")], "Sure, here:\nno commas at all" + bye.replace("!", ", ok")),
        ([i("punctuation:no_comma")], "Here it is\nno commas\nBye, friend"),
        ([i("change_case:english_lowercase")], "Sure! Here:\nall lowercase english words here"),
        ([i("change_case:english_lowercase")], "all lowercase english words here\nThanks!"),
        ([i("change_case:english_capital")], "Here you go:\nALL CAPITAL ENGLISH WORDS HERE\nEnjoy!"),
        ([i("detectable_format:title")], "Intro\n<<Title>>\nBody"),
        ([i("detectable_format:title")], "<<*Starred* Title>>\nBody"),
        ([i("detectable_content:postscript", postscript_marker="P.S.")], "Body.\n*P.S.* starred"),
        ([i("detectable_content:postscript", postscript_marker="P.P.S")], "Body.\n**P.P.S** starred"),
        ([i("detectable_format:number_bullet_lists", num_bullets=2)], "Here are two:\n* a\n* b\n* not a bullet"),
        ([i("detectable_format:number_bullet_lists", num_bullets=2)], "* intro\n* a\n* b"),
        ([i("detectable_format:number_bullet_lists", num_bullets=2)], "**Points**\n- a\n- b"),
        ([i("detectable_format:number_highlighted_sections", num_highlights=2)], "*one*\n*two*\nbye"),
        ([i("detectable_format:number_highlighted_sections", num_highlights=1)], "no highlights\nat all"),
        ([i("detectable_format:multiple_sections", section_spliter="SECTION", num_sections=2)],
         "Intro SECTION 1\nSECTION 2\nend"),
        ([i("detectable_format:multiple_sections", section_spliter="SECTION", num_sections=2)],
         "**SECTION 1**\na\n**SECTION 2**\nb"),
        ([i("length_constraints:number_paragraphs", num_paragraphs=2)], "Sure:\np1\n***\np2"),
        ([i("length_constraints:number_paragraphs", num_paragraphs=2)], "p1\n***\np2\n***\nBye"),
        ([i("length_constraints:number_paragraphs", num_paragraphs=2)], "p1\n***\np2\n***"),
        ([i("length_constraints:number_words", num_words=4, relation=LESS)], "Sure thing my friend:\none two three"),
        ([i("length_constraints:number_words", num_words=4, relation=LESS)], "one two\nthree four five"),
        ([i("length_constraints:number_sentences", num_sentences=2, relation=LESS)], "Sure. Here.\nOne sentence."),
        ([i("length_constraints:number_sentences", num_sentences=3, relation=LEAST)], "One. Two.\nThree."),
        ([i("length_constraints:nth_paragraph_first_word", num_paragraphs=2, nth_paragraph=1, first_word="alpha")],
         "Sure:\nAlpha is first.\n\nBeta second."),
        ([i("length_constraints:nth_paragraph_first_word", num_paragraphs=2, nth_paragraph=1, first_word="alpha")],
         "*Alpha* is first.\n\nBeta second."),
        ([i("keywords:existence", keywords=["banana"])], "I like ba*nana*s"),
        ([i("keywords:forbidden_words", forbidden_words=["sorry"])], "Sorry!\nHere is the answer."),
        ([i("keywords:forbidden_words", forbidden_words=["sorry"])], "Here is the answer.\nSorry for the wait."),
        ([i("keywords:forbidden_words", forbidden_words=["sorry"])], "Sorry,\nthe answer\nsorry"),
        ([i("keywords:frequency", keyword="yes", frequency=2, relation=LESS)], "yes\nyes and yes"),
        ([i("keywords:letter_frequency", letter="q", let_frequency=2, let_relation=LESS)], "Quiet quarters"),
        ([i("keywords:letter_frequency", letter="q", let_frequency=2, let_relation=LESS)], "Q\nquiet\nQ"),
        ([i("change_case:capital_word_frequency", capital_frequency=2, capital_relation=LESS)],
         "NOTE:\nthis is IMPORTANT\nOK"),
        ([i("detectable_format:constrained_response")], "Let me think.\nMy answer is *yes*."),
        ([i("detectable_format:constrained_response")], "**My answer is no.**"),
        ([i("combination:two_responses")], "Here are two:\nOne.\n******\nTwo."),
        ([i("combination:two_responses")], "One.\n******\nTwo.\n******"),
        ([i("combination:two_responses")], "One.\n******\n*Two.*"),
        ([i("language:response_language", language="es")],
         "Here is my answer:\nEsta es una respuesta escrita completamente en español."),
        ([i("detectable_content:number_placeholders", num_placeholders=2)], "Dear [name],\nsee you at [place]"),
        ([i("detectable_content:number_placeholders", num_placeholders=2)], "[a]\nmiddle\n[b]"),
        ([i("detectable_format:json_format"), i("startend:quotation")], '"{}"'),
        ([i("keywords:existence", keywords=["dog"]), i("punctuation:no_comma")], "Sure, here:\nmy dog runs"),
        ([i("detectable_format:title"), i("change_case:english_lowercase")], "<<title>>\nall lower words here"),
    ]


def all_cases() -> list[tuple[list[dict], str]]:
    return (keyword_cases() + language_cases() + length_cases() + content_cases() + format_cases()
            + combination_cases() + case_cases() + multi_cases() + loose_cases())


def main() -> None:
    spec = importlib.util.spec_from_file_location("ifeval_harness", HERE.parent / "test_scorer_ifeval.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    reference_verdicts = harness.reference_verdicts
    with harness.reference_module() as ref:
        lines = []
        for k, (instructions, response) in enumerate(all_cases()):
            strict, loose = reference_verdicts(ref, instructions, response)
            lines.append(json.dumps({"id": f"c{k:03d}", "instructions": instructions, "response": response,
                                     "ref_strict": strict, "ref_loose": loose}, ensure_ascii=False))
    (HERE / "ifeval_cases.jsonl").write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} cases")


if __name__ == "__main__":
    main()
