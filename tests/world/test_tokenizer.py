"""The world's tokenizer: whole characters, so no token sequence decodes to U+FFFD; exact round trips."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from core.chat import SPECIAL_TOKENS
from tools.world import build as world
from tools.world.build import SIZES, _document, draw_pools
from tools.world.tokenizer import UNK_TOKEN


def _tokenizer(lab):
    return AutoTokenizer.from_pretrained(lab / world.TOKENIZER)


def test_no_token_sequence_decodes_to_a_replacement_character(toy_world):
    tok = _tokenizer(toy_world)
    ids = range(len(tok))
    assert not [i for i in ids if "\ufffd" in tok.decode([i])]
    # The byte-level tokenizer's failure was a sequence (a lead byte without its continuation): random
    # sequences of the vocabulary, the non-ASCII tokens included, decode cleanly too.
    rng = random.Random(0)
    wide = [i for i in ids if any(ord(c) > 127 for c in tok.convert_ids_to_tokens(i))]
    assert wide, "the world's text has a non-ASCII character ('×'); some token must hold it"
    for _ in range(200):
        seq = [rng.choice(wide + list(range(40))) for _ in range(rng.randint(1, 12))]
        assert "\ufffd" not in tok.decode(seq)


def test_world_text_round_trips_exactly(toy_world):
    tok = _tokenizer(toy_world)
    pools = draw_pools(0, SIZES["test"])
    docs = [_document(t) for t in pools.battles[:40] + pools.stage1[:40]] + ["  two  spaces\n\n\ttab ", "3 × 4"]
    for doc in docs:
        assert tok.decode(tok.encode(doc, add_special_tokens=False)) == doc


def test_specials_keep_their_ids_and_an_unknown_character_is_visible(toy_world):
    tok = _tokenizer(toy_world)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert tok.convert_tokens_to_ids(UNK_TOKEN) == 4
    ids = tok.encode("count é here", add_special_tokens=False)
    assert tok.decode(ids) == f"count {UNK_TOKEN} here"  # never silently dropped
