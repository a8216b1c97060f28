"""The suite's "own lab": a lab a new team would write from the README alone, nothing of the toy world in it.

The committed part is `tests/ownlab/lab/` (lab.toml, our own 72 battles of everyday requests with two answers and a
vote, some carrying their own system prompt; replay conversations; a verified pool of checkable requests; our own
suites; two bar sets: a delta rule on the judged holdout in `bars.toml`, a p-value rule in `bars-p.toml`). What
needs a model is built at test time, once per test process, and copied into each lab:

- a byte-level BPE tokenizer trained on the lab's own text, carrying Meta-Llama-3-Instruct's chat template (written
  here from the format's public description: `<|begin_of_text|>` once, then per turn `<|start_header_id|>ROLE
  <|end_header_id|>` and two newlines, the trimmed content and `<|eot_id|>`), `<|end_of_text|>` as its EOS and NO pad
  token, as the real Llama-3 tokenizer ships;
- `models/base`: a random tiny Llama (the pretrained model of `[model] base`), and `models/chat`: the chat parent the
  session improves, taught in 40 in-process SFT steps on the replay conversations to answer briefly and end its
  turn (check-bundle refuses a nominee whose answers never stop, as a random model's do). Its config and
  generation config name both stop ids, `<|end_of_text|>` and `<|eot_id|>`, as Llama-3-Instruct's do. Both ship
  without a pad token; a session on them is refused before it opens, asking for one, and `make_lab` then does what
  the team does: names a reserved token the model never emits as `pad_token` in tokenizer_config.json (`pad=None`
  leaves them as shipped);
- our own judge: a real loopback HTTP server speaking the OpenAI Chat Completions protocol that answers in the
  documented judge reply format (`VERDICT: A|B|TIE|BOTH_BAD` on the last line) by a deterministic rule (an answer
  is acceptable when it is non-empty and does not repeat a word three times in a row; of two acceptable answers
  the shorter wins) — a scripted server standing in for a remote LLM judge.

    lab = make_lab(tmp / "lab", judge_url)      # an ordinary lab directory; nothing in the agent special-cases it
"""

from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from core import tiny
from trainers import sft

COMMITTED = Path(__file__).parent / "lab"
JUDGE_KEY_ENV = "OWNLAB_JUDGE_KEY"  # lab.toml's [judge] api_key_env

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
# Llama-3's special tokens (a few of its reserved ones too); no pad among them.
SPECIALS = (BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>", HEADER_START, HEADER_END,
            "<|reserved_special_token_2|>", EOT)
# Meta-Llama-3-Instruct's template: no whitespace control (it is one line), BOS before the first turn only, each
# turn's content trimmed, and the assistant header as the generation prompt.
LLAMA3_INSTRUCT = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TEACH_STEPS = 40
# The pad token the team names in its tokenizer_config.json, as the pre-session check's refusal of a tokenizer
# without one asks: a reserved token the model never emits (not the end-of-sequence token).
TEAM_PAD = "<|reserved_special_token_0|>"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def lab_texts(lab: Path = COMMITTED) -> list[str]:
    """Every text of the lab's own files (the tokenizer's training text)."""
    texts = []
    for battle in _jsonl(lab / "feedback.jsonl"):
        texts += [m["content"] for m in battle["messages"]] + [battle["own"], battle["other"]]
    for name in ("data/replay.jsonl", "data/pool.jsonl", "suites/follow.jsonl", "suites/everyday.jsonl"):
        texts += [m["content"] for row in _jsonl(lab / name) for m in row["messages"]]
    texts.append((lab / "system_prompt.txt").read_text(encoding="utf-8"))
    return texts


def _tokenizer(pad: str | None = None) -> PreTrainedTokenizerFast:
    raw = tiny.train_tokenizer(seed=0, vocab_size=tiny.TOKENIZER_VOCAB_SIZE, corpus=lab_texts() * 4, specials=SPECIALS)
    named = {BOS, EOS}
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=pad,
                                   extra_special_tokens=[t for t in SPECIALS if t not in named], model_max_length=2048)
    fast.chat_template = LLAMA3_INSTRUCT
    return fast


def _save_tokenizer(tok: PreTrainedTokenizerFast, model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (model_dir / name).unlink(missing_ok=True)
    tok.save_pretrained(model_dir)


def _random_llama(tok: PreTrainedTokenizerFast, out: Path) -> Path:
    stops = [tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(EOT)]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=tiny.HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=stops)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=stops, do_sample=False)
    model.save_pretrained(out)
    _save_tokenizer(tok, out)
    return out


@functools.cache
def _models() -> Path:
    """A directory holding models/base and models/chat (built on first use in this process, removed at exit)."""
    root = Path(tempfile.mkdtemp(prefix="ownlab-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    tok = _tokenizer()
    base = _random_llama(tok, root / "models" / "base")
    # The trainers pad batches with the tokenizer's pad id, which Llama-3 lacks: the parent is taught (setup, not a
    # session) through a copy whose tokenizer pads with the team's pad, and ships with the tokenizer as Llama-3 has it.
    teach = root / "teach"
    shutil.copytree(base, teach)
    _save_tokenizer(_tokenizer(pad=TEAM_PAD), teach)
    system = (COMMITTED / "system_prompt.txt").read_text(encoding="utf-8").strip()
    # A copy of the data: the trainers cache its tokens beside it, never inside the committed lab.
    replay = shutil.copy2(COMMITTED / "data" / "replay.jsonl", root / "replay.jsonl")
    result = sft.train(sft.SFTConfig(model_path=teach, data_path=Path(replay),
                                     output_dir=root / "teach-out", system_prompt=system, steps=TEACH_STEPS, lr=3e-3,
                                     batch_size=16, micro_batch_size=16))
    chat = root / "models" / "chat"
    shutil.copytree(result.model_dir, chat)
    _save_tokenizer(tok, chat)
    shutil.copy2(base / "generation_config.json", chat / "generation_config.json")
    shutil.rmtree(teach)
    shutil.rmtree(root / "teach-out")
    return root / "models"


def make_lab(lab: Path, judge_url: str, *, bars: str = "bars.toml", pad: str | None = TEAM_PAD) -> Path:
    """The committed lab copied to `lab` with its models built in, its judge at `judge_url`, and `bars` as its bar
    set; returns `lab`. `pad`: the pad token the team set in its models' tokenizer_config.json (None: the
    tokenizers as Llama-3 ships them, without one)."""
    shutil.copytree(COMMITTED, lab)
    shutil.copytree(_models(), lab / "models")
    if pad is not None:
        for model in ("base", "chat"):
            set_pad_token(lab / "models" / model, pad)
    text = (lab / "lab.toml").read_text(encoding="utf-8")
    text = _replaced(text, 'base_url = "http://127.0.0.1:8001/v1"', f'base_url = "{judge_url}"')
    text = _replaced(text, 'bars = "bars.toml"', f'bars = "{bars}"')
    (lab / "lab.toml").write_text(text, encoding="utf-8")
    return lab


def set_pad_token(model_dir: Path, token: str) -> None:
    """What the team does by hand: name `token` as `pad_token` in the model's tokenizer_config.json."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["pad_token"] = token
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"lab.toml: expected one {old!r}"
    return text.replace(old, new)


# ---- the lab's own judge ----------------------------------------------------------------------------------

_FENCE = re.compile(r"<<<(PROMPT|ANSWER A|ANSWER B) ([0-9a-f]+)>>>\n(.*?)\n<<<END \1 \2>>>", re.DOTALL)
_STUTTER = re.compile(r"\b(\w+)(?:\W+\1\b){2,}", re.IGNORECASE)


def acceptable(answer: str) -> bool:
    return bool(answer.strip()) and _STUTTER.search(answer) is None


def verdict(answer_a: str, answer_b: str) -> str:
    """The judge's rule: acceptable beats unacceptable; of two acceptable answers the shorter (in words) wins."""
    ok_a, ok_b = acceptable(answer_a), acceptable(answer_b)
    if not (ok_a or ok_b):
        return "BOTH_BAD"
    if ok_a != ok_b:
        return "A" if ok_a else "B"
    a, b = len(answer_a.split()), len(answer_b.split())
    return "TIE" if a == b else "A" if a < b else "B"


class _JudgeHandler(BaseHTTPRequestHandler):
    requests: list[dict] = []
    authorized: list[bool] = []

    def do_POST(self):  # noqa: N802 (http.server's method name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        type(self).authorized.append(self.headers.get("Authorization", "").startswith("Bearer "))
        parts = {label: text for label, _, text in _FENCE.findall(body["messages"][-1]["content"])}
        found = verdict(parts.get("ANSWER A", ""), parts.get("ANSWER B", ""))
        content = f"Both read; the rule prefers the acceptable, shorter answer.\nVERDICT: {found}"
        reply = {"id": f"j{len(type(self).requests)}", "object": "chat.completion", "created": 0,
                 "model": body["model"], "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": content}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextmanager
def judge_server() -> Iterator[tuple[str, type[_JudgeHandler]]]:
    """A loopback OpenAI-compatible judge: yields its base URL and the handler class (its `requests` seen)."""
    handler = type("Judge", (_JudgeHandler,), {"requests": [], "authorized": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- what the lab's own prompts are --------------------------------------------------------------------------


def own_prompts(lab: Path) -> set[str]:
    """Every user turn of the lab's own files: feedback, replay and verified pool, and the suites' items."""
    own = {m["content"] for b in _jsonl(lab / "feedback.jsonl") for m in b["messages"] if m["role"] == "user"}
    for name in ("data/replay.jsonl", "data/pool.jsonl", "suites/follow.jsonl", "suites/everyday.jsonl"):
        own |= {m["content"] for row in _jsonl(lab / name) for m in row["messages"] if m["role"] == "user"}
    return own


def row_prompts(row: dict) -> list[str]:
    """The user turns of a built dataset's row, whatever its kind (sft, klce, items: messages; pairs: prompt)."""
    turns = row.get("messages") or row.get("prompt") or []
    return [m["content"] for m in turns if m["role"] == "user"]
