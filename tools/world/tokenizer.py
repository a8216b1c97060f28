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

from core.chat import EOT_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, chat_template

UNK_TOKEN = "<|unk|>"
# GPT-2's pre-tokenization pattern (the one ByteLevel applies), on characters instead of bytes.
_PIECES = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def alphabet(corpus: Sequence[str]) -> list[str]:
    """Printable ASCII (whitespace included) and every other character the corpus uses, sorted."""
    return sorted(set(string.printable) | {c for doc in corpus for c in doc})


def build(out_dir: Path, corpus: Sequence[str], vocab_size: int) -> Path:
    """Trains the world's tokenizer on `corpus` and writes it (with the ChatML chat template) to `out_dir`.

    The ChatML special tokens take ids 0..3 (as in core.tiny's tokenizer) and UNK_TOKEN id 4."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECES), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, UNK_TOKEN],
                                  initial_alphabet=alphabet(corpus), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOT_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOT_TOKEN, PAD_TOKEN)],
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template()
    fast.save_pretrained(out_dir)
    return out_dir
