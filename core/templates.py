"""Chat-template families for offline tokenizers: each family's special tokens and its Jinja template.

The tiny tokenizers (core/tiny.py) and the toy world's (tools/world/tokenizer.py) are built on one of
these, so every code path that must honour a model's own template (training rows, loss masks, eval
prompts, stop ids, the shipped bundle) is exercised on the formats teams actually serve:

    chatml     Qwen2.5 / ChatML: `<|im_start|>role\\n...<|im_end|>\\n`
    llama3     Llama-3: BOS, `<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`, content trimmed
    gemma      Gemma: BOS, `<start_of_turn>user|model\\n...<end_of_turn>\\n`; no system role (the template
               raises on one, as Gemma's does); turns must alternate
    mistral    Mistral `[INST]`: BOS, `[INST] ... [/INST]answer</s>`; the template itself folds a system
               turn into the first user turn; no generation prompt
    nemotron   Nemotron-H: `<SPECIAL_10>System\\n...`, `<SPECIAL_11>User\\n...`, `<SPECIAL_11>Assistant\\n...<SPECIAL_12>\\n`,
               with transformers' `{% generation %}` markers around what an assistant turn trains on

The templates are written here from each family's published format (no hub download); the renderer
(core/chat.py) never names their tokens: it derives the end of turn, the stop ids and the system
handling from the template and the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TemplateFamily = Literal["chatml", "llama3", "gemma", "mistral", "nemotron"]
FAMILIES: tuple[TemplateFamily, ...] = ("chatml", "llama3", "gemma", "mistral", "nemotron")

# ChatML: also the template a model with none gets (core.chat.CHATML_TEMPLATE is this text).
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

GEMMA = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- raise_exception('System role not supported') -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

MISTRAL = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_text = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system_text = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '[INST] ' + (system_text if loop.first else '') + message['content'] + ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- message['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('Only user and assistant roles are supported after the system turn') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

NEMOTRON = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '<SPECIAL_10>System\\n' + messages[0]['content'] + '\\n' -}}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '<SPECIAL_11>User\\n' + message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<SPECIAL_11>Assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<SPECIAL_12>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<SPECIAL_11>Assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    """A template family's tokens: what a tokenizer of that family declares, and its template."""

    name: TemplateFamily
    template: str
    # Special tokens, in id order (they take ids 0..n-1 of a tiny vocabulary); pad first.
    specials: tuple[str, ...]
    pad: str
    eos: str
    bos: str | None


FAMILY: dict[TemplateFamily, Family] = {
    "chatml": Family("chatml", CHATML, ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                     pad="<|pad|>", eos="<|im_end|>", bos=None),
    "llama3": Family("llama3", LLAMA3, ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                                        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                     pad="<|finetune_right_pad_id|>", eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "gemma": Family("gemma", GEMMA, ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                    pad="<pad>", eos="<eos>", bos="<bos>"),
    "mistral": Family("mistral", MISTRAL, ("<pad>", "<s>", "</s>", "[INST]", "[/INST]"),
                      pad="<pad>", eos="</s>", bos="<s>"),
    "nemotron": Family("nemotron", NEMOTRON, ("<pad>", "<s>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
                       pad="<pad>", eos="</s>", bos="<s>"),
}


def family(name: str) -> Family:
    """The family called `name`; ValueError naming the known ones otherwise."""
    if name not in FAMILY:
        raise ValueError(f"template family {name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILY[name]
