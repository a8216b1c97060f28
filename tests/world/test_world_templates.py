"""`world build --template`: the world's tokenizer carries the chosen family's chat template and special tokens, so
a session on that world trains, evaluates and ships in it. (A whole session on a Llama-3-templated model is the own
lab's, tests/ownlab; this checks the world's own tokenizer build, which every template's world starts from.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from core import chat, loading
from core.templates import family
from tools.world import tokenizer

CORPUS = ["What is 2 + 2?\nAnswer: 4", "Name a colour.\nAnswer: blue", "You are a careful assistant."] * 4


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma"])
def test_the_world_tokenizer_carries_its_templates_format(template: str, tmp_path: Path):
    fam = family(template)
    tok = loading.load_tokenizer(tokenizer.build(tmp_path / "tok", CORPUS, vocab_size=300, template=template))
    fmt = chat.chat_format(tok)
    assert fmt.template == fam.template
    # The family's special tokens take the first ids, and each is one token, never split.
    assert tok.convert_tokens_to_ids(list(fam.specials)) == list(range(len(fam.specials)))
    rendered = chat.render(tok, [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}])
    assert tok.convert_tokens_to_ids(fmt.eot_token) in rendered.input_ids
    # Loss only on the answer and its end of turn.
    answer = [i for i, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if m]
    assert tok.decode(answer).strip().startswith("4") and answer[-1] == tok.convert_tokens_to_ids(fmt.eot_token)
