"""The one chat renderer: conversations -> text, token ids and the assistant-only loss mask.

Format (ChatML), for every message in order:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

and, for a generation prompt, a trailing `<|im_start|>assistant\\n`. The serving system prompt is
inserted as the first message when the conversation has none (a conversation's own system turn
wins, in the renderer and the template alike; a system turn anywhere but first is refused).

Supervision: the content of every assistant turn plus its `<|im_end|>` end-of-turn token carry loss
(mask 1); the role headers, system and user turns, the newline after `<|im_end|>` and padding do not.

`chat_template(system_prompt)` returns the Jinja template shipped with a model. It renders
byte-identically to `render_text` under the transformers Jinja environment (tests/trainers check
this on many conversations), so the renderer here is the single source of truth for training and
serving. Token ids come from tokenizing the whole rendered text once (exactly what a server does
with the template's output) and the mask from each token's character offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the renderer takes any HF tokenizer; importing transformers here would pull in torch
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<|pad|>"
TEXT_EOS_TOKEN = "<|endoftext|>"
BOT_TOKEN = "<|im_start|>"
EOT_TOKEN = "<|im_end|>"
# Order fixes their ids (0..3) in the tiny tokenizer.
SPECIAL_TOKENS = (PAD_TOKEN, TEXT_EOS_TOKEN, BOT_TOKEN, EOT_TOKEN)

Role = Literal["system", "user", "assistant"]


class Message(BaseModel):
    """One chat turn: the project's one message model (feedback, dataset rows, eval items, rendering)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Role = Field(description="Who speaks: system, user or assistant.")
    content: str = Field(description="The turn's text, verbatim.")


class Rendered(BaseModel):
    """A rendered conversation: the text, its token ids and the per-token loss mask."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(description="The rendered ChatML text (what the chat template produces).")
    input_ids: list[int] = Field(description="Token ids of `text`, tokenized in one piece.")
    loss_mask: list[int] = Field(description="1 where the token is assistant content or its <|im_end|>, else 0.")


def _messages(messages: Sequence[Message | dict], system_prompt: str | None) -> list[Message]:
    """Parses turns and applies the serving system prompt as the default first turn.

    A conversation's own system turn wins, as it does in the shipped template (a server must accept
    requests that carry their own system prompt)."""
    parsed = [m if isinstance(m, Message) else Message.model_validate(m) for m in messages]
    for i, m in enumerate(parsed):
        if m.role == "system" and i != 0:
            raise ValueError(f"chat: message {i} has role 'system'; a system turn may only come first")
    if system_prompt is None or (parsed and parsed[0].role == "system"):
        return parsed
    return [Message(role="system", content=system_prompt), *parsed]


def _segments(messages: list[Message], add_generation_prompt: bool) -> list[tuple[str, bool]]:
    """The rendered text as (piece, supervised) pieces; their concatenation is the full text."""
    pieces: list[tuple[str, bool]] = []
    for m in messages:
        pieces.append((f"{BOT_TOKEN}{m.role}\n", False))
        supervised = m.role == "assistant"
        pieces.append((m.content + EOT_TOKEN, supervised))
        pieces.append(("\n", False))
    if add_generation_prompt:
        pieces.append((f"{BOT_TOKEN}assistant\n", False))
    return pieces


def render_text(
    messages: Sequence[Message | dict], system_prompt: str | None = None, add_generation_prompt: bool = False
) -> str:
    """The rendered ChatML text of a conversation (what `apply_chat_template(tokenize=False)` returns)."""
    return "".join(p for p, _ in _segments(_messages(messages, system_prompt), add_generation_prompt))


def render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message | dict], system_prompt: str | None = None
) -> Rendered:
    """Token ids and assistant-only loss mask of a whole conversation (for training rows)."""
    check_tokenizer(tokenizer)
    segments = _segments(_messages(messages, system_prompt), add_generation_prompt=False)
    text = "".join(p for p, _ in segments)
    spans, pos = [], 0
    for piece, supervised in segments:
        if supervised:
            spans.append((pos, pos + len(piece)))
        pos += len(piece)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    # A token is supervised when it starts inside an assistant span. A token straddling the header/content
    # boundary (possible for some tokenizers) starts in the header, so it stays unsupervised.
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return Rendered(text=text, input_ids=list(enc["input_ids"]), loss_mask=mask)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message | dict], system_prompt: str | None = None
) -> list[int]:
    """Token ids of a generation prompt: the conversation followed by `<|im_start|>assistant\\n`."""
    check_tokenizer(tokenizer)
    text = render_text(messages, system_prompt, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuses a tokenizer that does not hold the ChatML markers as single special tokens."""
    for token in (BOT_TOKEN, EOT_TOKEN):
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"chat: tokenizer does not encode {token!r} as one token (got {ids})")


def eot_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id of the end-of-turn token `<|im_end|>` (the serving stop id)."""
    check_tokenizer(tokenizer)
    return tokenizer.convert_tokens_to_ids(EOT_TOKEN)


def _jinja_literal(text: str) -> str:
    """A Jinja string literal that evaluates to `text` exactly: every character outside [A-Za-z0-9 ] is
    written as a \\UXXXXXXXX escape, so quotes, backslashes, CR/LF and Jinja markers stay data."""
    body = "".join(c if (c.isascii() and (c.isalnum() or c == " ")) else f"\\U{ord(c):08x}" for c in text)
    return "'" + body + "'"


def chat_template(system_prompt: str | None = None) -> str:
    """The Jinja chat template equivalent to `render_text(..., system_prompt)`.

    Every tag uses whitespace control (`{%-`/`-%}`) so the result does not depend on the environment's
    trim_blocks/lstrip_blocks settings; all text is emitted from string literals.
    """
    default_system = ""
    if system_prompt is not None:
        default_system = (
            "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
            "{{- '" + BOT_TOKEN + "system\\n' + " + _jinja_literal(system_prompt) + " + '" + EOT_TOKEN + "\\n' -}}"
            "{%- endif -%}"
        )
    return (
        default_system
        + "{%- for message in messages -%}"
        "{{- '" + BOT_TOKEN + "' + message['role'] + '\\n' + message['content'] + '" + EOT_TOKEN + "\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '" + BOT_TOKEN + "assistant\\n' -}}{%- endif -%}"
    )
