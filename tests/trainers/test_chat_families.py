"""Every chat-template family (core/templates.py: ChatML/Qwen2.5, Llama-3, Gemma, Mistral [INST], Nemotron) through the
one renderer: masks, eval prompts, training rows against TRL 1.16, stop ids, and refusals.

Each family's tokenizer is built offline (core.tiny.build_tokenizer(template=...)); nothing here names a family's
tokens except to state what a test expects to see.
"""

from __future__ import annotations

import pytest
from trainer_testkit import assistant, user
from transformers import AutoTokenizer

from core import chat, tiny
from core.templates import FAMILIES
from trainers.batch import cut_answer, encode

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

SYSTEM = "You are terse."
# Multi-turn, with and without a system turn; contents with whitespace a template may trim, and markup-like text.
CONVERSATIONS = [
    [user("What is 12 + 30?"), assistant("42")],
    [{"role": "system", "content": SYSTEM}, user("Count the words: a b c"), assistant("There are 3."),
     user("And now 'x y'?\n\nThanks"), assistant("  2\n")],
    [user("Hi"), assistant("Hello!"), user("{{ not jinja }} {% if %} é 😀"), assistant("Fine, thanks."),
     user("Bye"), assistant("Bye.")],
]
# The content each template writes for a turn: Llama-3's and Gemma's templates trim it.
TRIMS = {"llama3", "gemma"}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: tiny.build_tokenizer(root / f, template=f) for f in FAMILIES}


@pytest.fixture(scope="module")
def toks(family_dirs):
    return {f: AutoTokenizer.from_pretrained(d) for f, d in family_dirs.items()}


def _shown(family: str, content: str) -> str:
    return content.strip() if family in TRIMS else content


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_each_family_derives_its_end_of_turn_system_handling_and_masking(toks):
    got = {f: (chat.chat_format(t).eot_token, chat.chat_format(t).system_turns, chat.chat_format(t).masking)
           for f, t in toks.items()}
    assert got == {"chatml": ("<|im_end|>", "native", "prefix"), "llama3": ("<|eot_id|>", "native", "prefix"),
                   "gemma": ("<end_of_turn>", "folded", "prefix"), "mistral": ("</s>", "native", "prefix"),
                   "nemotron": ("<SPECIAL_12>", "native", "generation-markers")}
    for t in toks.values():
        fmt = chat.chat_format(t)
        assert fmt.source == "model" and fmt.stop_token_ids[0] == t.convert_tokens_to_ids(fmt.eot_token)
        assert fmt.stop_token_ids == [fmt.eot_id] + ([t.eos_token_id] if t.eos_token_id != fmt.eot_id else [])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("system_prompt", [None, "Answer briefly."])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_mask_covers_exactly_each_assistant_turn_and_its_end_of_turn(toks, family, conversation, system_prompt):
    tok = toks[family]
    fmt = chat.chat_format(tok)
    r = chat.render(tok, conversation, system_prompt)
    assert r.input_ids == tok(r.text, add_special_tokens=False)["input_ids"] and len(r.loss_mask) == len(r.input_ids)
    turns = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    runs = _runs(r.loss_mask)
    assert len(runs) == len(turns)
    for (start, end), i in zip(runs, turns, strict=True):
        # The turn starts right after the conversation so far with the generation prompt ...
        prompt = chat.render_prompt(tok, conversation[:i], system_prompt)
        assert r.input_ids[:start] == prompt
        # ... and is the content as the template writes it, then the end-of-turn token, nothing after.
        assert r.input_ids[end - 1] == fmt.eot_id
        assert tok.decode(r.input_ids[start:end]) == _shown(family, conversation[i]["content"]) + fmt.eot_token
    # Every other end-of-turn token (closing a system or user turn) carries no loss.
    closing_other = [i for i, (t, m) in enumerate(zip(r.input_ids, r.loss_mask, strict=True)) if t == fmt.eot_id and not m]
    assert all(not r.loss_mask[i] for i in closing_other)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conversation", [c[:-1] for c in CONVERSATIONS])
def test_eval_prompts_equal_apply_chat_template_with_the_generation_prompt(toks, family, conversation):
    tok = toks[family]
    # transformers' own rendering of the model's own template (a Gemma-style template is given the system turn
    # folded into the first user turn, the only way it takes one)
    sent = chat._fold(conversation) if chat.chat_format(tok).system_turns == "folded" else conversation
    expected = tok.apply_chat_template(sent, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.render_prompt(tok, conversation) == list(expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_serving_system_prompt_follows_the_templates_system_handling(toks, family):
    tok = toks[family]
    text = chat.render_text(tok, [user("Hi")], "Be brief.", add_generation_prompt=True)
    assert "Be brief." in text
    if family == "gemma":  # no system role: folded into the first user turn
        assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>" in text
    # The shipped template renders the same bytes under transformers, for any conversation.
    shipped = chat.serving_template(tok, "Be brief.")
    for conversation in CONVERSATIONS:
        for generation in (False, True):
            assert tok.apply_chat_template(conversation, chat_template=shipped, tokenize=False,
                                           add_generation_prompt=generation) == \
                chat.render_text(tok, conversation, "Be brief.", generation)


# ---- training rows as TRL tokenizes them -----------------------------------------------------------------


@pytest.fixture(scope="module")
def family_models(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("family-models")
    return {f: tiny.build_model("llama", d, root / f) for f, d in family_dirs.items()}


def _trl_args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, **kw)


def _labelled(row) -> list[int]:
    return [int(label != -100) for label in row["labels"]]


def _as_template_takes_it(tok, conversation):
    """What TRL is handed: the conversation itself, its system turn folded for a template without a system role
    (TRL renders with the raw template, which would raise on it)."""
    return chat._fold(conversation) if chat.chat_format(tok).system_turns == "folded" else conversation


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_and_klce_rows_tokenize_as_trl_sft_trainer(toks, family_models, family, tmp_path):
    """SFT and KL-CE rows are both `trainers.batch.encode` of a conversation (trainers/sft.py, trainers/klce.py)."""
    from transformers import AutoModelForCausalLM

    tok = toks[family]
    fmt = chat.chat_format(tok)
    model = AutoModelForCausalLM.from_pretrained(family_models[family])
    convs = [_as_template_takes_it(tok, c) for c in CONVERSATIONS]
    markers = fmt.masking == "generation-markers"
    whole = trl.SFTTrainer(model=model, processing_class=tok,
                           args=_trl_args(trl.SFTConfig, tmp_path / "whole", assistant_only_loss=markers),
                           train_dataset=datasets.Dataset.from_list([{"messages": c} for c in convs]))
    # The last assistant turn as TRL's prompt-completion split sees it (completion-only loss).
    split = trl.SFTTrainer(model=model, processing_class=tok, args=_trl_args(trl.SFTConfig, tmp_path / "split"),
                           train_dataset=datasets.Dataset.from_list(
                               [{"prompt": c[:-1], "completion": c[-1:]} for c in convs]))
    after = tok(fmt.after_eot, add_special_tokens=False)["input_ids"] if fmt.after_eot else []
    for i, conversation in enumerate(CONVERSATIONS):
        ours = encode(tok, conversation, None, 4096)
        assert whole.train_dataset[i]["input_ids"] == ours.input_ids
        if markers:  # TRL's labels (from the {% generation %} markers' assistant mask) are our loss mask
            assert _labelled(whole.train_dataset[i]) == ours.loss_mask
        row = split.train_dataset[i]
        assert row["input_ids"] == ours.input_ids
        start, end = _runs(ours.loss_mask)[-1]
        # TRL's completion is our last supervised run plus what the template writes after the end-of-turn token
        # (which the model never generates: it stops on the end of turn).
        assert _labelled(row) == [0] * start + [1] * (len(ours.input_ids) - start)
        assert ours.input_ids[end:] == after


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_rows_tokenize_as_trl_dpo_trainer(toks, family_models, family, tmp_path):
    from transformers import AutoModelForCausalLM

    tok = toks[family]
    fmt = chat.chat_format(tok)
    model = AutoModelForCausalLM.from_pretrained(family_models[family])
    pairs = [([user("What is 1 + 1?")], "The answer is 2.", "No."),
             ([{"role": "system", "content": SYSTEM}, user("Hi"), assistant("Hello."), user("Name a colour.")],
              "Blue.", "  I cannot say.  ")]
    data = [{"prompt": _as_template_takes_it(tok, p), "chosen": [assistant(c)], "rejected": [assistant(r)]}
            for p, c, r in pairs]
    trainer = trl.DPOTrainer(model=model, args=_trl_args(trl.DPOConfig, tmp_path), processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(data))
    after = tok(fmt.after_eot, add_special_tokens=False)["input_ids"] if fmt.after_eot else []
    for i, (prompt, chosen, rejected) in enumerate(pairs):
        row = trainer.train_dataset[i]
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            ours = cut_answer(tok, prompt, answer, system_prompt=None, max_len=4096, max_prompt_length=None,
                              max_completion_length=None)
            assert row["prompt_ids"] + row[f"{side}_ids"] == ours.input_ids
            start, end = _runs(ours.loss_mask)[-1]
            assert start == len(row["prompt_ids"])  # the answer starts where TRL's prompt ends ...
            assert row[f"{side}_ids"] == ours.input_ids[start:end] + after  # ... and ends on the end of turn


# ---- templates that cannot be trained with -----------------------------------------------------------------


def test_a_template_without_a_stable_prefix_or_markers_is_refused_with_the_reason(toks):
    tok = AutoTokenizer.from_pretrained(toks["chatml"].name_or_path)
    # Numbers every turn from the end: the first turns render differently once more follow (no stable prefix).
    tok.chat_template = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + ' '"
                         " + (messages | length - loop.index0) | string + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
                         "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    with pytest.raises(chat.ChatTemplateError, match="not prefixes of the whole conversation .* no \\{% generation %\\} "
                                                     "markers: assistant tokens cannot be masked"):
        chat.chat_format(tok)
    # The same template with generation markers can be masked.
    tok.chat_template = tok.chat_template.replace(
        "'\\n' + message['content'] + '<|im_end|>\\n' -}}",
        "'\\n' -}}{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}")
    assert chat.chat_format(tok).masking == "generation-markers"


def test_a_tokenizer_without_a_template_gets_chatml_and_says_so(toks):
    tok = AutoTokenizer.from_pretrained(toks["chatml"].name_or_path)
    tok.chat_template = None
    fmt = chat.chat_format(tok)
    assert fmt.source == "chatml-default" and fmt.template == chat.CHATML_TEMPLATE and fmt.eot_token == "<|im_end|>"
    assert chat.render_text(tok, [user("Hi")], add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
