"""Tiny models and the offline tokenizer: product code (the toy world is built from them) that tests reuse.

Everything here is built offline and deterministically in seconds on a CPU:

- `build_tokenizer(out_dir, template="chatml")`: a byte-level BPE tokenizer trained with the `tokenizers`
  library on synthetic text (arithmetic, counting, digit sums, string edits, short chat sentences), with
  the special tokens and the chat template of a template family (core/templates.py: chatml, llama3,
  gemma, mistral, nemotron), saved as a `PreTrainedTokenizerFast` directory.
- `build_model(kind, tokenizer_dir, out_dir, seed)`: a randomly initialised causal LM saved with
  `save_pretrained` (safetensors) next to a copy of the tokenizer: `nemotron_h` (Mamba2, attention,
  MoE and MLP layers), `llama` or `qwen2`.
- `build_reward_model(tokenizer_dir, out_dir, seed)`: a tiny Llama sequence-classification model with
  one output (a scalar reward), for the reward-proxy scorer.

Command (builds all of them under DIR):

    .venv/bin/python -m core.tiny DIR
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from core.chat import stop_ids
from core.templates import FAMILIES, Family, TemplateFamily, family

ModelKind = Literal["nemotron_h", "llama", "qwen2"]
MODEL_KINDS: tuple[ModelKind, ...] = ("nemotron_h", "llama", "qwen2")

TOKENIZER_VOCAB_SIZE = 1024
HIDDEN = 64

_WORDS = (
    "the a an cat dog bird fish tree river stone cloud apple banana cherry number answer question "
    "count sum digit letter word string reverse upper lower add subtract multiply equals is are was "
    "please compute what how many times result total first last each every format list json yes no "
    "hello thanks sure here you your model assistant user system helpful short correct wrong because"
).split()


def _synthetic_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic training text that covers the toy world's task families and chat markup."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        kind = i % 6
        if kind == 0:
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        elif kind == 1:
            lines.append(f"What is {a} * {b % 20}? {a} * {b % 20} = {a * (b % 20)}")
        elif kind == 2:
            lines.append(f"Count the words in: {words}. There are {len(words.split())} words.")
        elif kind == 3:
            lines.append(f"The digit sum of {a}{b} is {sum(int(c) for c in f'{a}{b}')}.")
        elif kind == 4:
            lines.append(f'Reverse "{words}": "{words[::-1]}". Upper: {words.upper()}')
        else:
            lines.append(f'{{"answer": {a}, "words": "{words}"}}\n- {words}\n- {a - b}')
    return lines


def train_tokenizer(seed: int = 0, vocab_size: int = TOKENIZER_VOCAB_SIZE,
                    corpus: Sequence[str] | None = None, specials: Sequence[str] = family("chatml").specials) -> Tokenizer:
    """Trains a byte-level BPE `tokenizers.Tokenizer` on `corpus` (default: the built-in synthetic text);
    the special tokens take ids 0..len(specials)-1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed) if corpus is None else corpus, trainer=trainer)
    return tok


def family_tokenizer(tok: Tokenizer, fam: Family, **kw) -> PreTrainedTokenizerFast:
    """A trained `tokenizers.Tokenizer` as a `PreTrainedTokenizerFast` declaring the family's special tokens and
    carrying its chat template."""
    named = {fam.pad, fam.eos} | ({fam.bos} if fam.bos else set())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=fam.eos, pad_token=fam.pad, bos_token=fam.bos,
        extra_special_tokens=[t for t in fam.specials if t not in named], model_max_length=2048, **kw,
    )
    fast.chat_template = fam.template
    return fast


def build_tokenizer(out_dir: str | Path, seed: int = 0, corpus: Sequence[str] | None = None,
                    vocab_size: int = TOKENIZER_VOCAB_SIZE, template: TemplateFamily = "chatml") -> Path:
    """Writes a `PreTrainedTokenizerFast` directory with the special tokens and chat template of the
    `template` family, and returns it.

    `corpus` is the text to train on (the toy world passes its own); default: the built-in synthetic text."""
    fam = family(template)
    out = Path(out_dir)
    family_tokenizer(train_tokenizer(seed, vocab_size, corpus, fam.specials), fam).save_pretrained(out)
    return out


def special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """A model config's special ids: pad, the template's end of turn as EOS, and the tokenizer's BOS (for a family
    without one, its first extra special token: ChatML's text EOS), so every id the config names is a real token."""
    bos = tokenizer.bos_token_id
    if bos is None:
        bos = tokenizer.convert_tokens_to_ids(tokenizer.extra_special_tokens[0])
    return {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": stop_ids(tokenizer)[0], "bos_token_id": bos}


def _nemotron_h_config(vocab: int, special: dict[str, int]) -> NemotronHConfig:
    # One of each block type (Mamba2, MoE, attention, MLP) so every code path of the hybrid runs.
    return NemotronHConfig(
        vocab_size=vocab, hidden_size=HIDDEN,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, max_position_embeddings=2048,
        tie_word_embeddings=False, **special,
    )


def _dense_config(kind: ModelKind, vocab: int, special: dict[str, int]) -> LlamaConfig | Qwen2Config:
    cls = LlamaConfig if kind == "llama" else Qwen2Config
    return cls(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, **special,
    )


def build_model(kind: ModelKind, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Writes a tiny random causal LM (safetensors) plus its tokenizer and generation config."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"build_model: kind {kind!r} is not one of {MODEL_KINDS}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    special = special_ids(tokenizer)
    torch.manual_seed(seed)
    if kind == "nemotron_h":
        model = NemotronHForCausalLM(_nemotron_h_config(len(tokenizer), special))
    else:
        config = _dense_config(kind, len(tokenizer), special)
        model = (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(config)
    # Serving stops on the stop ids the chat template and the tokenizer give (core.chat.stop_ids).
    model.generation_config = GenerationConfig(
        eos_token_id=stop_ids(tokenizer), pad_token_id=special["pad_token_id"], do_sample=False,
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_reward_model(tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Writes a tiny Llama with a one-output classification head: a scalar reward per sequence."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = _dense_config("llama", len(tokenizer), special_ids(tokenizer))
    config.num_labels = 1
    model = LlamaForSequenceClassification(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    """`python -m core.tiny DIR`: builds tokenizer/, nemotron_h/, llama/, qwen2/ and reward/ under DIR."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--template", choices=FAMILIES, default="chatml", help="Chat-template family of the tokenizer.")
    args = parser.parse_args()
    tok_dir = build_tokenizer(args.out_dir / "tokenizer", seed=args.seed, template=args.template)
    for kind in MODEL_KINDS:
        print(build_model(kind, tok_dir, args.out_dir / kind, seed=args.seed))
    print(build_reward_model(tok_dir, args.out_dir / "reward", seed=args.seed))


if __name__ == "__main__":
    main()
