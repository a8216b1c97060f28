"""The toy world's tokenizer: BPE over whole characters, so that no token sequence decodes to U+FFFD.

A byte-level BPE (core.tiny's) holds one token per byte. The world's text has one non-ASCII character
("×", two bytes in UTF-8), so such a vocabulary holds its two lone bytes as tokens of their own, and a
tiny model that samples the first without the second answers with U+FFFD, which check-bundle rightly
refuses. Here the alphabet is characters instead: printable ASCII and whitespace, plus every other
character of the corpus, each a token whole. Every token is a string of whole characters, so every
sequence of them decodes to valid text.

Pieces come from a split that keeps every character of the text (GPT-2's pattern, "isolated"), and the
decoder concatenates tokens (`Fuse`), so encode/decode round-trips any text built from the alphabet
exactly, whitespace included. A character outside the alphabet becomes UNK_TOKEN (visible as such when
decoded), never a silently dropped character.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

from core.templates import TemplateFamily, family

UNK_TOKEN = "<|unk|>"
# GPT-2's pre-tokenization pattern (the one ByteLevel applies), on characters instead of bytes.
_PIECES = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def alphabet(corpus: Sequence[str]) -> list[str]:
    """Printable ASCII (whitespace included) and every other character the corpus uses, sorted."""
    return sorted(set(string.printable) | {c for doc in corpus for c in doc})


def build(out_dir: Path, corpus: Sequence[str], vocab_size: int, template: TemplateFamily = "chatml") -> Path:
    """Trains the world's tokenizer on `corpus` and writes it, with the special tokens and chat template of
    the `template` family (core/templates.py), to `out_dir`.

    The family's special tokens take the first ids (ChatML's 0..3, as in core.tiny's tokenizer), UNK_TOKEN the next."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from core.tiny import family_tokenizer

    fam = family(template)
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECES), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*fam.specials, UNK_TOKEN],
                                  initial_alphabet=alphabet(corpus), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    family_tokenizer(tok, fam, unk_token=UNK_TOKEN, clean_up_tokenization_spaces=False).save_pretrained(out_dir)
    return out_dir
