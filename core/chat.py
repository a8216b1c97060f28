"""The one chat renderer: conversations -> text, token ids and the assistant-only loss mask, in the
model's own chat template.

The template is the tokenizer's `chat_template`, rendered by transformers itself
(`tokenizer.apply_chat_template`), so training rows, eval prompts and the shipped bundle see the bytes
a server produces. A tokenizer with no template gets ChatML (`CHATML_TEMPLATE`); `chat_format` says
which one it was (the session's `open` decision and the model card record it).

Everything else is derived from the template and the tokenizer, never named here (`chat_format`):

- the end-of-turn token: the first token of what the template writes after an assistant turn's
  content; it must be one special token of the tokenizer. The stop ids are it and the tokenizer's
  EOS (when that is another token);
- system turns: a template that renders a system turn (natively, or by folding it in itself) gets
  it as is; one that raises on it or drops it gets it folded into the first user turn
  (`system + "\\n\\n" + user`), as such models are served. The serving system prompt is a default
  first system turn (a conversation's own system turn wins; a system turn anywhere but first is
  refused), then handled the same way;
- supervision (`loss_mask`): assistant content plus its end-of-turn token carry loss; headers, other
  turns, whatever the template writes after the end-of-turn token and padding do not. Where the
  template has transformers' `{% generation %}` markers, the mask is theirs
  (`return_assistant_tokens_mask`); otherwise it comes from prefix differences: the conversation up
  to an assistant turn, rendered with the generation prompt, must be a prefix of the whole, and the
  turn runs from there to its end-of-turn token. A template that has neither (its rendering of the
  first turns is not a prefix of the whole conversation) cannot be masked and is refused
  (ChatTemplateError), before any session opens.

`serving_template(tokenizer, system_prompt)` is the template shipped in a bundle: the training
template behind a short preamble that applies the served system prompt and the system-turn fold,
so a server rendering it produces byte for byte what `render_text` produced in training
(check-bundle verifies this, in transformers' Jinja2 and in minijinja, the engine of TGI and other
servers: the preamble's strings use only the escapes both read alike, and transformers' training-only
`{% generation %}` markers are written as plain blocks). Token ids come from tokenizing the whole rendered text once, without
added special tokens (exactly what `apply_chat_template(tokenize=True)` does), except that a special token's text
inside a message's content (the public's text) is split into ordinary tokens: special tokens are read only where
the template wrote them (`_encode`).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field

from core.templates import CHATML, FAMILY

if TYPE_CHECKING:  # the renderer takes any HF tokenizer; importing transformers here would pull in torch
    from transformers import PreTrainedTokenizerBase

# The ChatML family's tokens: what the offline ChatML tokenizers are built with (core/tiny.py, the toy world).
# The renderer itself never uses them: it derives a model's tokens from its template (`chat_format`).
PAD_TOKEN, TEXT_EOS_TOKEN, BOT_TOKEN, EOT_TOKEN = FAMILY["chatml"].specials
SPECIAL_TOKENS = FAMILY["chatml"].specials
CHATML_TEMPLATE = CHATML
# How a system turn joins the first user turn for a template with no system role (Gemma 3's own template
# writes it this way).
FOLD_SEPARATOR = "\n\n"

Role = Literal["system", "user", "assistant"]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatTemplateError(ValueError):
    """A chat template the renderer cannot train with (it cannot be masked, or it renders no end-of-turn token)."""


class Message(BaseModel):
    """One chat turn: the project's one message model (feedback, dataset rows, eval items, rendering)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Role = Field(description="Who speaks: system, user or assistant.")
    content: str = Field(description="The turn's text, verbatim.")


class Rendered(BaseModel):
    """A rendered conversation: the text, its token ids and the per-token loss mask."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(description="The rendered text (what the chat template produces).")
    input_ids: list[int] = Field(description="Token ids of `text`, tokenized in one piece.")
    loss_mask: list[int] = Field(description="1 where the token is assistant content or its end-of-turn token, else 0.")


class ChatFormat(BaseModel):
    """What the renderer derived from a tokenizer's chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    template: str = Field(description="The template rows are rendered with: the tokenizer's own, or ChatML.")
    source: Literal["model", "chatml-default"] = Field(
        description="'model': the tokenizer's own template; 'chatml-default': it had none, so ChatML.")
    system_turns: Literal["native", "folded"] = Field(
        description="'native': the template renders a system turn; 'folded': it has no system role, so a system "
        "turn is folded into the first user turn.")
    masking: Literal["generation-markers", "prefix"] = Field(
        description="How the assistant-only loss mask is found: the template's {% generation %} markers, or "
        "prefix differences of renderings.")
    eot_token: str = Field(description="The end-of-turn token the template closes an assistant turn with.")
    after_eot: str = Field(description="Text the template writes after the end-of-turn token (never supervised).")
    stop_token_ids: list[int] = Field(description="Serving stop ids: the end-of-turn token's, then the tokenizer's EOS "
                                                  "when that is another token.")

    @property
    def eot_id(self) -> int:
        return self.stop_token_ids[0]


# ---- deriving the format -----------------------------------------------------------------------------

_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _own_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    own = tokenizer.chat_template
    if isinstance(own, dict):  # several named templates: the one a plain apply_chat_template call uses
        own = own.get("default")
    return own or None


def template_of(tokenizer: PreTrainedTokenizerBase) -> str:
    """The template training renders with: the tokenizer's own, or ChatML when it has none."""
    return _own_template(tokenizer) or CHATML_TEMPLATE


def _apply(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _renders_system(tokenizer, template: str) -> bool:
    """Whether the template renders a system turn (natively or folding it in itself)."""
    probe = "Sysprobe7"
    try:
        text = _apply(tokenizer, template, [{"role": "system", "content": probe},
                                            {"role": "user", "content": "Userprobe"}], False)
    except jinja2.TemplateError:
        return False
    return probe in text


def _end_of_turn(tokenizer, template: str) -> tuple[str, str]:
    """The end-of-turn token and the text after it, read from how the template closes an assistant turn."""
    user = [{"role": "user", "content": "Userprobe"}]
    answer = "Answerprobe"
    whole = _apply(tokenizer, template, [*user, {"role": "assistant", "content": answer}], False)
    if answer not in whole:
        raise ChatTemplateError("the template does not write an assistant turn's content: nothing to train on")
    closing = whole[whole.rindex(answer) + len(answer):]
    ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    first = tokenizer.convert_ids_to_tokens(ids[0]) if ids else None
    special = {t for t in tokenizer.all_special_tokens} | set(tokenizer.get_added_vocab())
    if first is None or first not in special or not closing.startswith(first):
        raise ChatTemplateError(f"the template closes an assistant turn with {closing[:40]!r}, which does not start "
                                "with a special token of the tokenizer: no end-of-turn token to stop on")
    return first, closing[len(first):]


def _probe_conversations(system_turns: str) -> list[list[dict]]:
    """Two-turn conversations, with and without a system turn, that a maskable template renders prefix-stably."""
    turns = [{"role": "user", "content": "First question"}, {"role": "assistant", "content": "First answer"},
             {"role": "user", "content": "Second question"}, {"role": "assistant", "content": "Second answer"}]
    with_system = [{"role": "system", "content": "System text"}, *turns]
    return [_fold(with_system) if system_turns == "folded" else with_system, turns]


def format_probes() -> list[list[dict]]:
    """Every conversation chat_format renders (_prefix_spans renders their prefixes too): what the agent process
    may render only after core/template_bounds.py saw the template render them in bounds in a child."""
    return [[{"role": "system", "content": "Sysprobe7"}, {"role": "user", "content": "Userprobe"}],
            [{"role": "user", "content": "Userprobe"}, {"role": "assistant", "content": "Answerprobe"}],
            *_probe_conversations("native"), *_probe_conversations("folded")]


def chat_format(tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """The tokenizer's chat format (cached per tokenizer and template); ChatTemplateError with the reason
    when the template cannot be trained with."""
    template = template_of(tokenizer)
    cached = _FORMATS.get(tokenizer)
    if cached is not None and cached.template == template:
        return cached
    try:
        system_turns = "native" if _renders_system(tokenizer, template) else "folded"
        eot, after = _end_of_turn(tokenizer, template)
        masking = "generation-markers" if _GENERATION_TAG.search(template) else "prefix"
        if masking == "prefix":
            for conv in _probe_conversations(system_turns):
                _prefix_spans(tokenizer, template, conv, eot, after)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template does not render a plain conversation ({err})") from None
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    eos = tokenizer.eos_token_id
    stops = [eot_id] + ([eos] if eos is not None and eos != eot_id else [])
    fmt = ChatFormat(template=template, source="model" if _own_template(tokenizer) else "chatml-default",
                     system_turns=system_turns,
                     masking=masking, eot_token=eot, after_eot=after, stop_token_ids=stops)
    _FORMATS[tokenizer] = fmt
    return fmt


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """Refuses (ChatTemplateError, with the reason) a tokenizer whose template cannot be trained with."""
    return chat_format(tokenizer)


def eot_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id of the template's end-of-turn token (the first serving stop id)."""
    return chat_format(tokenizer).eot_id


def stop_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The serving stop ids: the end-of-turn token, then the tokenizer's EOS when that is another token."""
    return list(chat_format(tokenizer).stop_token_ids)


# ---- rendering ---------------------------------------------------------------------------------------


def _fold(messages: list[dict]) -> list[dict]:
    """A leading system turn folded into the first user turn (for templates with no system role)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        return [{"role": "user", "content": system + FOLD_SEPARATOR + rest[0]["content"]}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


def _messages(messages: Sequence[Message | dict], system_prompt: str | None, fmt: ChatFormat) -> list[dict]:
    """Parses turns, applies the serving system prompt as the default first turn and folds a system turn
    for a template without a system role. A conversation's own system turn wins, as it does in the
    shipped template (a server must accept requests that carry their own system prompt)."""
    parsed = [m if isinstance(m, Message) else Message.model_validate(m) for m in messages]
    for i, m in enumerate(parsed):
        if m.role == "system" and i != 0:
            raise ValueError(f"chat: message {i} has role 'system'; a system turn may only come first")
    out = [m.model_dump() for m in parsed]
    if system_prompt is not None and not (out and out[0]["role"] == "system"):
        out = [{"role": "system", "content": system_prompt}, *out]
    return _fold(out) if fmt.system_turns == "folded" else out


def render_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message | dict], system_prompt: str | None = None,
                add_generation_prompt: bool = False) -> str:
    """The rendered text of a conversation in the tokenizer's template (what a server's
    `apply_chat_template(tokenize=False)` returns with the shipped template)."""
    fmt = chat_format(tokenizer)
    return _apply(tokenizer, fmt.template, _messages(messages, system_prompt, fmt), add_generation_prompt)


def _prefix_spans(tokenizer, template: str, messages: list[dict], eot: str, after: str) -> list[tuple[int, int]]:
    """Character spans of every assistant turn's content + end-of-turn token, by prefix differences."""
    whole = _apply(tokenizer, template, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _apply(tokenizer, template, messages[:i], True) if i else ""
        through = _apply(tokenizer, template, messages[: i + 1], False)
        end = len(through) - len(after)
        if not (whole.startswith(before) and whole.startswith(through) and through[:end].endswith(eot)
                and through.endswith(after) and end - len(eot) >= len(before)):
            raise ChatTemplateError(
                f"the template's rendering of the first {i} turns (with the generation prompt) and of the first {i + 1} "
                "are not prefixes of the whole conversation ending in the end-of-turn token, and it has no "
                "{% generation %} markers: assistant tokens cannot be masked")
        spans.append((len(before), end))
    return spans


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message | dict], system_prompt: str | None = None
           ) -> Rendered:
    """Token ids and assistant-only loss mask of a whole conversation (for training rows)."""
    fmt = chat_format(tokenizer)
    msgs = _messages(messages, system_prompt, fmt)
    text = _apply(tokenizer, fmt.template, msgs, False)
    if fmt.masking == "generation-markers":
        enc = tokenizer.apply_chat_template(msgs, chat_template=fmt.template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        if not _carries_control(tokenizer, msgs):
            return Rendered(text=text, input_ids=list(enc["input_ids"]), loss_mask=list(enc["assistant_masks"]))
        # The markers' mask is over the whole text's tokens (the same as a plain tokenization of it): as spans.
        plain = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        spans = [span for span, m in zip(plain, enc["assistant_masks"], strict=True) if m]
    else:
        spans = _prefix_spans(tokenizer, fmt.template, msgs, fmt.eot_token, fmt.after_eot)
    ids, offsets = _encode(tokenizer, fmt.template, msgs, text, False)
    # A token is supervised when it starts inside an assistant span. A token straddling the header/content
    # boundary (possible for some tokenizers) starts in the header, so it stays unsupervised.
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in offsets]
    return Rendered(text=text, input_ids=ids, loss_mask=mask)


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message | dict],
                  system_prompt: str | None = None) -> list[int]:
    """Token ids of a generation prompt: the conversation followed by the template's generation prompt."""
    fmt = chat_format(tokenizer)
    msgs = _messages(messages, system_prompt, fmt)
    return _encode(tokenizer, fmt.template, msgs, _apply(tokenizer, fmt.template, msgs, True), True)[0]


# ---- tokenizing: the public's text never becomes control ---------------------------------------------
# Message contents are the public's text (battle prompts and answers). Tokenizing the rendered text as a whole
# would read a content's `<|im_end|>\n<|im_start|>user` as the template's own special tokens: a training row would
# supervise a forged end of turn and forged turns, an eval prompt would carry them. So a special token counts
# as one only where the template wrote it; inside a content its text is split into ordinary tokens, as
# transformers' `split_special_tokens=True` splits it.


def control_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts this tokenizer reads as special tokens (what `split_special_tokens` splits), longest first."""
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted((s for s in specials if s), key=len, reverse=True)


def _carries_control(tokenizer, msgs: list[dict]) -> bool:
    return any(s in m["content"] for s in control_strings(tokenizer) for m in msgs)


def _encode(tokenizer, template: str, msgs: list[dict], text: str, add_generation_prompt: bool
            ) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text` (the rendering of `msgs`), special tokens only where the template
    wrote them. Which ones those are: the conversation rendered again with every control string inside a content
    blanked to filler of its length, so the template writes the same text at the same places; a special token
    whose characters differ between the two came from a content. The text between the template's own special
    tokens is then tokenized with special tokens split (each piece apart, as the tokenizer itself splits a text at
    its special tokens); a conversation without control strings in its contents is tokenized exactly as before."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if not _carries_control(tokenizer, msgs):
        return ids, offsets
    controls = control_strings(tokenizer)
    filler = next(c for c in "x~#*" if not any(c in s for s in controls))
    blanked = [m | {"content": _blank(m["content"], controls, filler)} for m in msgs]
    neutral = _apply(tokenizer, template, blanked, add_generation_prompt)
    if len(neutral) != len(text):
        raise ChatTemplateError("a message carries the chat template's control strings and the template renders it "
                                "differently when they are blanked: its own special tokens cannot be told apart")
    special_ids = set(tokenizer.convert_tokens_to_ids(controls))
    own = [k for k, (i, (a, b)) in enumerate(zip(ids, offsets, strict=True))
           if i in special_ids and neutral[a:b] == text[a:b]]
    out_ids: list[int] = []
    out_offsets: list[tuple[int, int]] = []
    cursor = 0
    for k in [*own, None]:
        end = len(text) if k is None else offsets[k][0]
        if end > cursor:
            piece = tokenizer(text[cursor:end], add_special_tokens=False, return_offsets_mapping=True,
                              split_special_tokens=True)
            out_ids += piece["input_ids"]
            out_offsets += [(a + cursor, b + cursor) for a, b in piece["offset_mapping"]]
        if k is not None:
            out_ids.append(ids[k])
            out_offsets.append(offsets[k])
            cursor = offsets[k][1]
    return out_ids, out_offsets


def _blank(content: str, controls: list[str], filler: str) -> str:
    for s in controls:
        content = content.replace(s, filler * len(s))
    return content


# ---- the shipped template ----------------------------------------------------------------------------


def _jinja_literal(text: str) -> str:
    """A Jinja string literal that evaluates to `text` exactly, in Python's Jinja2 and in minijinja (the Rust engine
    of TGI and other servers) alike: every character of the Basic Multilingual Plane outside [A-Za-z0-9 ] is written
    as a JSON-style \\uXXXX escape, so quotes, backslashes, CR/LF and Jinja markers stay data. Those are the escapes
    both engines read the same way: minijinja leaves Python's \\UXXXXXXXX as text, and reads a surrogate pair as one
    character where Jinja2 reads two, so a character beyond the BMP (an emoji) is written as itself, which both
    read from UTF-8 as is."""
    body = "".join(c if (c.isascii() and (c.isalnum() or c == " ")) or ord(c) > 0xFFFF else f"\\u{ord(c):04x}"
                   for c in text)
    return "'" + body + "'"


# transformers' `{% generation %}` markers: a training-only extension (assistant masks) that servers' Jinja
# engines do not know (minijinja refuses the unknown tag). The shipped template writes each as an `if true`
# block with the same whitespace control, which renders the same text in every engine.
_GENERATION_MARKER = re.compile(r"{%([-+]?)\s*(end)?generation\s*([-+]?)%}")


def without_generation_markers(template: str) -> str:
    return _GENERATION_MARKER.sub(lambda m: "{%" + m[1] + (" endif " if m[2] else " if true ") + m[3] + "%}", template)


def wrap_template(template: str, system_prompt: str | None, system_turns: str) -> str:
    """`template` behind a preamble that does what `_messages` does: the default system turn, then the fold.

    Top-level `{% set messages = ... %}` rebinds the conversation for the rest of the template. Every tag
    uses whitespace control so the preamble writes nothing, whatever trim_blocks/lstrip_blocks say."""
    preamble = ""
    if system_prompt is not None:
        preamble += ("{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
                     "{%- set messages = [{'role': 'system', 'content': " + _jinja_literal(system_prompt) + "}] + messages -%}"
                     "{%- endif -%}")
    if system_turns == "folded":
        sep = _jinja_literal(FOLD_SEPARATOR)
        preamble += ("{%- if messages | length > 0 and messages[0]['role'] == 'system' -%}"
                     "{%- if messages | length > 1 and messages[1]['role'] == 'user' -%}"
                     "{%- set messages = [{'role': 'user', 'content': messages[0]['content'] + " + sep
                     + " + messages[1]['content']}] + messages[2:] -%}"
                     "{%- else -%}"
                     "{%- set messages = [{'role': 'user', 'content': messages[0]['content']}] + messages[1:] -%}"
                     "{%- endif -%}"
                     "{%- endif -%}")
    return preamble + template


def serving_template(tokenizer: PreTrainedTokenizerBase, system_prompt: str | None) -> str:
    """The template a bundle ships: renders exactly what `render_text(tokenizer, ..., system_prompt)` does."""
    fmt = chat_format(tokenizer)
    return wrap_template(without_generation_markers(fmt.template), system_prompt, fmt.system_turns)


def chat_template(system_prompt: str | None = None) -> str:
    """ChatML as a shipped template, with `system_prompt` as the default system turn (a model with no
    template of its own)."""
    return wrap_template(CHATML_TEMPLATE, system_prompt, "native")
