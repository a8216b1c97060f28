"""The one renderer on the ChatML tokenizer: template parity with apply_chat_template, and the assistant-only mask.
(Every template family: tests/trainers/test_chat_families.py.)"""

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from core import chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count the words: a b c"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "And now 'x y'?\n\nThanks"},
        {"role": "assistant", "content": "  2\n"},
    ],
    [{"role": "user", "content": "{{ not jinja }} {% if %} <|im_end|>? é 😀"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
]
SYSTEM_PROMPTS = [None, "Be brief.", "\n  Quotes ' \" and \\ backslash,\r\n{% raw %} {{ x }} 😀 trailing  "]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("system_prompt", SYSTEM_PROMPTS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation", [False, True])
def test_template_renders_byte_identically(tok, conversation, system_prompt, generation):
    expected = chat.render_text(tok, conversation, system_prompt, add_generation_prompt=generation)
    got = tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=generation,
        chat_template=chat.serving_template(tok, system_prompt),
    )
    assert got == expected


def test_shipped_tokenizer_template_is_the_renderer(tok):
    rendered, _ = render_jinja_template([CONVERSATIONS[1]], chat_template=tok.chat_template)
    assert rendered[0] == chat.render_text(tok, CONVERSATIONS[1])


def test_mask_covers_assistant_content_and_end_of_turn_only(tok):
    r = chat.render(tok, CONVERSATIONS[1])
    assert len(r.input_ids) == len(r.loss_mask)
    assert tok.decode(r.input_ids) == r.text
    supervised = [i for i, m in zip(r.input_ids, r.loss_mask, strict=True) if m]
    assert tok.decode(supervised) == "3<|im_end|>  2\n<|im_end|>"
    eot = chat.eot_id(tok)
    # Every <|im_end|> closing a user or system turn stays unsupervised.
    assert sum(1 for i, m in zip(r.input_ids, r.loss_mask, strict=True) if i == eot and not m) == 3


def test_ids_equal_tokenizing_the_template_output(tok):
    # A content carrying the template's control strings is tokenized with them split (tests/trainers/test_public_control.py).
    for conversation in [c for c in CONVERSATIONS if not any("<|im_end|>" in m["content"] for m in c)]:
        r = chat.render(tok, conversation, "Be brief.")
        served = tok.apply_chat_template(conversation, tokenize=False,
                                         chat_template=chat.serving_template(tok, "Be brief."))
        assert r.input_ids == tok(served, add_special_tokens=False)["input_ids"]


def test_prompt_ends_with_assistant_header(tok):
    ids = chat.render_prompt(tok, CONVERSATIONS[0][:1], "Be brief.")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_own_system_turn_wins_over_serving_prompt(tok):
    assert chat.render_text(tok, CONVERSATIONS[1], "Another prompt").startswith("<|im_start|>system\nYou are terse.")


def test_misplaced_system_turn_and_unknown_role_are_refused(tok):
    with pytest.raises(ValueError, match="message 1 has role 'system'"):
        chat.render_text(tok, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="role"):
        chat.render_text(tok, [{"role": "tool", "content": "a"}])


def test_tokenizer_without_template_or_chat_markers_is_refused(tmp_path):
    """No template of its own, so ChatML; but ChatML's end of turn is no token of this tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.add_tokens(list("abc"))
    with pytest.raises(chat.ChatTemplateError, match=r"closes an assistant turn with '<\|im_end\|>\\n', which does "
                       "not start with a special token"):
        chat.render(PreTrainedTokenizerFast(tokenizer_object=raw), CONVERSATIONS[0])
