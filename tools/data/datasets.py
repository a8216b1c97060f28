"""Dataset builders: feedback, local data and synthetic tasks -> audited JSONL training sets.

Every builder is a plain function of one pydantic config that returns a `DatasetManifest`:

- `build_winner_sft`: the human-preferred answer of each decisive train battle (own and opponent wins),
  optionally cleaned of citation markers and source links and repeated N times;
- `build_battle_pairs`: DPO pairs from decisive train battles (chosen = preferred, rejected = the other);
- `build_replay_mix`: seeded samples of local chat datasets (JSONL or Parquet with `messages`), capped per source;
- `build_synthetic_verified`: generated tasks whose reference answers the eval checker accepts (the toy world's
  own measurements, tools/world/measure.py; no session step builds it: a session uses the lab's own data only);
- `build_mix`: a weighted, shuffled concatenation of already built datasets.

Chat rows keep their own leading system turn (a battle's own system prompt: what the user saw, and what
the eval prompts built from the same battles keep); the serving system prompt is added only to a row
that has none (none when it is empty). The one renderer and the shipped template do the same: a
conversation's own system turn wins. A system turn anywhere but first, which no template renders, is dropped.

Every build runs the leak audit (tools/data/leak.py) of its training prompts against the dev and sealed
holdouts of the feedback split and against every eval suite prompt. The audit rejects rows, never the
build: a row that overlaps is dropped, its count and ids recorded in the manifest (`leak_dropped`,
`leak_dropped_ids`; the audit result holds each hit), and the rest is built (four public battles that
copy eval prompts must not cost the session an arm). A build with no row left writes nothing. The rows
and the manifest (content sha256, rows, tokens, source files and their sha256, config, audit result and
its sha256) are written to temporary files and renamed into place.

Command (CONFIG is the builder's config as JSON; exit 2 on bad input, or when no row is left):

    .venv/bin/python -m tools.data.datasets {winner_sft,battle_pairs,replay_mix,synthetic_verified,mix} CONFIG.json
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.chat import Message, render
from core.jsonl import JSONLError, describe_non_file, is_parquet, read_lines, read_values
from core.util import canonical_json, file_sha256, write_atomic
from evals.synthetic import FAMILIES, Family, check, generate
from evals.types import Item
from memory.notebook import Artifact, Notebook
from tools.data.feedback import Battle, FeedbackError, load_feedback
from tools.data.leak import (
    DEFAULT_NGRAM,
    AuditResult,
    Reference,
    ReferenceIndex,
    audit,
    prompt_text,
)
from tools.data.splits import Split
from trainers.rows import KLCERow, PreferenceRow, SFTRow

RowKind = Literal["sft", "pairs", "items", "klce"]
MAX_LISTED = 20


class DatasetError(ValueError):
    """A build refused for bad input (a bad data row, a mismatched split, an existing artifact)."""


# ---- configs ---------------------------------------------------------------------------------------


class _BuildConfig(BaseModel):
    """What every build needs: where to write, how to count tokens, and what to audit against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out: Path = Field(description="Output JSONL path; the manifest is written beside it as <stem>.manifest.json.")
    tokenizer: Path = Field(description="Tokenizer directory used for the manifest's token count.")
    feedback: Path = Field(description="The lab's feedback file; its dev and sealed battles are audit references.")
    split: Path = Field(description="The split JSON written at ingestion (tools.data.splits.Split) for that file.")
    eval_suites: list[Path] = Field(default_factory=list, description="Eval suite item files (JSONL of evals Items).")
    ngram: int = Field(DEFAULT_NGRAM, ge=5, description="Word n-gram length of the leak audit's overlap check.")


class WinnerSFTConfig(_BuildConfig):
    system_prompt: str = Field(description="The serving system prompt the rows are rendered under ('' for none).")
    repeat: int = Field(1, ge=1, description="Times each preferred answer is repeated in the output.")
    cleanup: bool = Field(False, description="Strip citation markers, markdown source links and 'Sources' sections.")


class BattlePairsConfig(_BuildConfig):
    system_prompt: str = Field(description="The serving system prompt the prompts are rendered under ('' for none).")
    cleanup: bool = Field(False, description="Strip citation markers, markdown source links and 'Sources' sections.")


class ReplaySource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Short name of the source (lab.toml [[data]] name).")
    path: Path = Field(description="JSONL or Parquet file of chat rows with a `messages` column.")
    cap: int | None = Field(None, gt=0, description="Most rows sampled from this source; all rows when unset.")


class VerifiedSource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Short name of the pool (lab.toml [[data]] name, kind = 'verified').")
    path: Path = Field(description="JSONL of eval items (evals.types.Item: prompt plus what the verifier checks).")
    verifier: str = Field(description="The [[evals]] suite whose scorer verifies an answer to these items.")


class VerifiedPoolConfig(_BuildConfig):
    source: VerifiedSource = Field(description="The lab's verified pool the items are drawn from.")
    n: int | None = Field(None, gt=0, description="Items drawn (seeded sample); all when unset.")
    seed: int = Field(0, description="Sampling seed.")


class ReplayMixConfig(_BuildConfig):
    system_prompt: str = Field(description="The serving system prompt the rows are rendered under ('' for none).")
    sources: list[ReplaySource] = Field(min_length=1, description="Local chat datasets to sample from.")
    seed: int = Field(0, description="Sampling seed.")


class SyntheticVerifiedConfig(_BuildConfig):
    system_prompt: str = Field(description="The serving system prompt the rows are rendered under ('' for none).")
    rows: Literal["sft", "items"] = Field(
        "sft", description="'sft': prompt + verified reference answer; 'items': eval items (RFT prompt rows, gold kept).")
    counts: dict[Family, int] = Field(min_length=1, description="Tasks generated per family.")
    seed: int = Field(0, description="Generation seed (use a different one from any synthetic eval suite).")


class MixPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(description="A built dataset (JSONL with its manifest beside it).")
    weight: float = Field(gt=0, description="Row multiplier: floor(w) full copies plus a seeded sample of the fraction.")
    kl_only: bool = Field(False, description="Replay part for KL-leashed CE: its rows carry only the KL term. Any "
                                             "kl_only part makes the output KL-CE rows (trainers.rows.KLCERow).")


class MixConfig(_BuildConfig):
    parts: list[MixPart] = Field(min_length=1, description="Built datasets to combine; all of one row kind.")
    seed: int = Field(0, description="Seed of the fractional samples and of the final shuffle.")


# ---- manifest --------------------------------------------------------------------------------------


class SourceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(description="feedback, split, eval_suite, replay or dataset.")
    path: str = Field(description="Path of the file as given.")
    sha256: str = Field(description="sha256 of its bytes at build time.")


class DatasetManifest(BaseModel):
    """Provenance of one built dataset; its canonical JSON is the notebook artifact's recipe."""

    model_config = ConfigDict(extra="forbid")

    builder: str = Field(description="winner_sft, battle_pairs, replay_mix, synthetic_verified or mix.")
    path: str = Field(description="The dataset file.")
    format: Literal["jsonl"] = Field(description="File format.")
    row_kind: RowKind = Field(
        description="'sft' (trainers.rows.SFTRow), 'pairs' (PreferenceRow), 'klce' (KLCERow) or 'items' (evals Item).")
    sha256: str = Field(description="sha256 of the dataset file's bytes.")
    rows: int = Field(description="Number of rows.")
    tokens: int = Field(description="Tokens of all rendered rows (pairs: chosen and rejected conversations).")
    row_tokens_p99: int | None = Field(None, description="99th-percentile rendered row length (pairs: the longer "
                                       "conversation); the default max_len of an arm on it. None: not recorded.")
    tokenizer: str = Field(description="Tokenizer directory used to count tokens.")
    sources: list[SourceFile] = Field(description="Every input file and its sha256.")
    config: dict[str, Any] = Field(description="The builder config, as JSON.")
    stats: dict[str, int] = Field(description="Builder-specific counts (excluded battles, replaced system turns...).")
    audit: AuditResult = Field(description="The leak audit of the training prompts (before the overlapping rows were "
                               "dropped: its hits are the dropped rows).")
    audit_sha256: str = Field(description="sha256 of the audit result's canonical JSON.")
    leak_dropped: int = Field(0, ge=0, description="Rows dropped because their prompt overlaps a holdout or eval prompt.")
    leak_dropped_ids: list[str] = Field(default_factory=list, description="The dropped rows' ids ('row N' for a row "
                                        "without one), in row order.")


def audit_clean(recipe: dict[str, Any]) -> bool:
    """Whether a dataset's recorded manifest (an artifact's recipe) shows a leak audit that left no
    overlapping row in it: the audit ran and every row it hit was dropped. The one answer the gates, the
    planner's summary and the bundle's evidence read."""
    audit_result = recipe.get("audit")
    return isinstance(audit_result, dict) and recipe.get("leak_dropped", 0) == len(audit_result.get("hits", []))


def manifest_path(dataset: Path) -> Path:
    return dataset.with_name(dataset.stem + ".manifest.json")


def read_manifest(dataset: Path) -> DatasetManifest:
    """The manifest of a built dataset, after checking that the file still has the recorded sha256."""
    mpath = manifest_path(dataset)
    if not mpath.is_file():
        raise DatasetError(f"{dataset}: no manifest at {mpath}; only built datasets can be mixed")
    manifest = DatasetManifest.model_validate_json(mpath.read_text(encoding="utf-8"))
    if file_sha256(dataset) != manifest.sha256:
        raise DatasetError(f"{dataset}: sha256 differs from its manifest {mpath}; the file was changed after the build")
    return manifest


# ---- shared pieces ---------------------------------------------------------------------------------

# One number per bracket ([1][2] strips twice): a list such as [0, 1] in an answer is content, not a citation.
_CITATION = re.compile(r"\s?(?:【[^】]*】|\[\^?\d{1,3}\])")
_MD_LINK = re.compile(r"\[([^\]\n]+)\]\((?:https?://|www\.)[^)\s]*\)")
_SOURCES_HEAD = re.compile(r"^\s*(?:#+\s*)?\**(?:sources|references|citations)\**\s*:?\s*\**\s*$", re.IGNORECASE)
_LIST_OR_LINK = re.compile(r"^\s*(?:[-*•]|\d+[.)]|\[\d+\])\s+\S|^\s*(?:https?://|www\.)\S+\s*$")
_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.DOTALL)


def clean_answer(text: str) -> str:
    """Strips web-search residue from an answer: citation markers ([1], [^2], 【3†source】), markdown
    links to URLs (the link text stays) and a trailing Sources/References section. Code is kept as is."""
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):  # even parts lie outside code blocks and inline code
        parts[i] = _MD_LINK.sub(r"\1", _CITATION.sub("", parts[i]))
    return _drop_sources_section("".join(parts)).strip()


def _drop_sources_section(text: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        rest = lines[i + 1 :]
        if _SOURCES_HEAD.match(line) and all(not ln.strip() or _LIST_OR_LINK.match(ln) for ln in rest):
            return "\n".join(lines[:i])
    return text


def served(messages: Iterable[dict], system_prompt: str) -> list[dict]:
    """The conversation as served: its own leading system turn kept, else the serving one (none if empty); a
    system turn anywhere but first dropped (the renderer refuses one there)."""
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    own = turns[:1] if turns and turns[0]["role"] == "system" else []
    rest = [t for t in turns[len(own):] if t["role"] != "system"]
    return (own or ([{"role": "system", "content": system_prompt}] if system_prompt else [])) + rest


def _battle_turns(battle: Battle) -> list[dict]:
    return [m.model_dump() for m in battle.messages]


ROW_MODELS: dict[RowKind, type[BaseModel]] = {"sft": SFTRow, "pairs": PreferenceRow, "items": Item, "klce": KLCERow}


def _row_prompt(row: dict, kind: RowKind) -> str:
    return prompt_text(row["prompt"] if kind == "pairs" else row["messages"])


def _check_rows(builder: str, rows: list[dict], kind: RowKind) -> None:
    """Every row must parse as what the trainers read (trainers/rows.py); a failure is a builder bug."""
    for i, row in enumerate(rows):
        try:
            ROW_MODELS[kind].model_validate(row)
        except ValidationError as e:
            raise DatasetError(f"{builder}: row {i} ({row.get('id')}) is not a valid {kind} row: {e.errors()[0]['msg']}") from e


def _load_split(cfg: _BuildConfig) -> tuple[list[Battle], Split]:
    parsed = load_feedback(cfg.feedback)
    split = Split.model_validate_json(Path(cfg.split).read_text(encoding="utf-8"))
    if split.source_sha256 != parsed.sha256:
        raise DatasetError(f"{cfg.split}: split of a feedback file with sha256 {split.source_sha256[:16]}..., "
                           f"but {cfg.feedback} has sha256 {parsed.sha256[:16]}...; re-ingest the feedback")
    missing = {b.id for b in parsed.battles} ^ set(split.assignment)
    if missing:
        raise DatasetError(f"{cfg.split}: split and {cfg.feedback} disagree on battle ids, e.g. {sorted(missing)[:3]}")
    return parsed.battles, split


def _suite_references(path: Path) -> list[Reference]:
    refs = []
    try:
        lines = read_values(path)
    except JSONLError as e:
        raise DatasetError(str(e)) from None
    for number, value in lines:
        try:
            item = Item.model_validate(value)
        except ValidationError as e:
            raise DatasetError(f"{path} line {number}: not an eval item ({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from e
        refs.append(Reference(source=f"eval:{Path(path).name}", key=item.id,
                              text=prompt_text([m.model_dump() for m in item.messages])))
    return refs


def references(cfg: _BuildConfig) -> tuple[list[Reference], list[Battle], Split]:
    """Audit references of a build: the split's dev and sealed battles and every eval suite prompt."""
    battles, split = _load_split(cfg)
    refs = [Reference(source=split.assignment[b.id], key=b.id, text=b.prompt())
            for b in battles if split.assignment[b.id] != "train"]
    for suite in cfg.eval_suites:
        refs += _suite_references(suite)
    return refs, battles, split


def _input_files(cfg: _BuildConfig) -> list[SourceFile]:
    files = [("feedback", cfg.feedback), ("split", cfg.split), *(("eval_suite", p) for p in cfg.eval_suites)]
    return [SourceFile(role=r, path=str(p), sha256=file_sha256(p)) for r, p in files]


def count_tokens(tokenizer_dir: Path, rows: list[dict], kind: RowKind) -> int:
    """Tokens of every rendered row under the one chat renderer (pairs count both conversations)."""
    return sum(sum(n) for n in row_lengths(tokenizer_dir, rows, kind))


def row_lengths(tokenizer_dir: Path, rows: list[dict], kind: RowKind) -> list[tuple[int, ...]]:
    """Each row's rendered length under the one chat renderer: (conversation,), pairs (chosen, rejected)."""
    # Imported here, not at the top: the session's input check reads data rows without loading torch.
    from core import loading

    tok = loading.load_tokenizer(str(tokenizer_dir))
    if kind != "pairs":
        return [(len(render(tok, r["messages"]).input_ids),) for r in rows]
    return [tuple(len(render(tok, [*r["prompt"], {"role": "assistant", "content": r[side]}]).input_ids)
                  for side in ("chosen", "rejected")) for r in rows]


def p99(lengths: list[tuple[int, ...]]) -> int | None:
    """The 99th-percentile row length (a pair: its longer conversation), nearest rank; None for no rows. What a
    [train] without max_len trains at (trainers/recipe.py): 1% of rows cut, not the longest outlier's length."""
    longest = sorted(max(n) for n in lengths)
    return longest[max(0, math.ceil(0.99 * len(longest)) - 1)] if longest else None


def _finish(builder: str, kind: RowKind, cfg: _BuildConfig, rows: list[dict], refs: list[Reference],
            extra_sources: list[SourceFile], stats: dict[str, int]) -> DatasetManifest:
    """Audit, drop the rows that overlap, count, write rows and manifest, return the manifest."""
    _check_rows(builder, rows, kind)
    result = audit([_row_prompt(r, kind) for r in rows], refs, cfg.ngram, ids=[r.get("id") for r in rows])
    dropped = {h.row for h in result.hits}
    if dropped and len(dropped) == len(rows):
        raise DatasetError(f"{builder} -> {cfg.out}: all {len(rows)} training prompt(s) overlap holdout or eval "
                           "prompts (the leak audit dropped every row); nothing to build")
    rows = [r for i, r in enumerate(rows) if i not in dropped]
    data = "".join(canonical_json(r) + "\n" for r in rows).encode()
    sha = hashlib.sha256(data).hexdigest()
    out = Path(cfg.out)
    if out.exists() and file_sha256(out) != sha:
        raise DatasetError(f"{out} exists with different content; datasets are immutable, choose a new path")
    lengths = row_lengths(cfg.tokenizer, rows, kind)
    manifest = DatasetManifest(
        builder=builder, path=str(out), format="jsonl", row_kind=kind, sha256=sha, rows=len(rows),
        tokens=sum(sum(n) for n in lengths), row_tokens_p99=p99(lengths), tokenizer=str(cfg.tokenizer),
        sources=_input_files(cfg) + extra_sources, config=cfg.model_dump(mode="json"), stats=stats,
        audit=result, audit_sha256=result.sha256(), leak_dropped=len(dropped),
        leak_dropped_ids=[h.row_id or f"row {h.row}" for h in result.hits],
    )
    # Rows first, manifest last: a manifest on disk always describes a complete dataset file.
    write_atomic(out, data)
    write_atomic(manifest_path(out), (manifest.model_dump_json(indent=2) + "\n").encode())
    return manifest


def _decisive_train(battles: list[Battle], split: Split) -> tuple[list[Battle], dict[str, int]]:
    train = [b for b in battles if split.assignment[b.id] == "train"]
    decisive = [b for b in train if b.preferred is not None]
    stats = {"train_battles": len(train), "decisive": len(decisive), "excluded_tie_or_both_bad": len(train) - len(decisive),
             "holdout_battles_excluded": len(battles) - len(train),
             "battle_system_turns_kept": sum(bool(b.messages) and b.messages[0].role == "system" for b in decisive)}
    return decisive, stats


# ---- builders --------------------------------------------------------------------------------------


def build_winner_sft(cfg: WinnerSFTConfig) -> DatasetManifest:
    """SFT rows: each decisive train battle's conversation answered by the human-preferred answer."""
    refs, battles, split = references(cfg)
    decisive, stats = _decisive_train(battles, split)
    rows = []
    for b in decisive:
        answer = clean_answer(b.preferred) if cfg.cleanup else b.preferred
        if not answer:
            raise DatasetError(f"{cfg.feedback}: battle {b.id}: the preferred answer is empty after cleanup")
        turns = [*served(_battle_turns(b), cfg.system_prompt), {"role": "assistant", "content": answer}]
        rows += [{"id": f"{b.id}#{k}", "messages": turns} for k in range(cfg.repeat)]
    stats |= {"own_wins": sum(b.vote == "own" for b in decisive), "other_wins": sum(b.vote == "other" for b in decisive)}
    return _finish("winner_sft", "sft", cfg, rows, refs, [], stats)


def build_battle_pairs(cfg: BattlePairsConfig) -> DatasetManifest:
    """DPO rows: prompt, chosen = preferred answer, rejected = the other; ties and both-bad excluded."""
    refs, battles, split = references(cfg)
    decisive, stats = _decisive_train(battles, split)
    rows, same = [], 0
    for b in decisive:
        chosen, rejected = (clean_answer(b.preferred), clean_answer(b.rejected)) if cfg.cleanup else (b.preferred, b.rejected)
        if chosen == rejected:  # no preference signal left to learn from
            same += 1
            continue
        rows.append({"id": b.id, "prompt": served(_battle_turns(b), cfg.system_prompt), "chosen": chosen, "rejected": rejected})
    return _finish("battle_pairs", "pairs", cfg, rows, refs, [], stats | {"identical_pairs_dropped": same})


def read_chat_rows(path: Path) -> list[dict]:
    """`messages` of every row of a local chat dataset; DatasetError listing every bad row."""
    path = Path(path)
    why = describe_non_file(path)
    if why is not None:
        raise DatasetError(f"{path}: {why}")
    if is_parquet(path):
        import pyarrow.parquet as pq

        raw = [(i, r, None) for i, r in enumerate(pq.read_table(path, columns=["messages"]).to_pylist(), start=1)]
    else:
        try:
            raw = read_lines(path)
        except JSONLError as e:
            raise DatasetError(str(e)) from None
    rows, problems = [], []
    for i, r, unreadable in raw:
        problem = unreadable or _chat_row_problem(r)
        if problem:
            problems.append(f"  row {i}: {problem}")
        else:
            rows.append({"messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]})
    if problems:
        more = [f"  ... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
        raise DatasetError(f"{path}: {len(problems)} bad row(s), nothing built:\n" + "\n".join(problems[:MAX_LISTED] + more))
    return rows


def _chat_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        return "messages: expected a non-empty list of {role, content}"
    for j, m in enumerate(row["messages"]):
        try:
            Message.model_validate(m)
        except ValidationError as e:
            err = e.errors()[0]
            return f"messages.{j}.{'.'.join(map(str, err['loc'])) or '-'}: {err['msg'].removeprefix('Value error, ')}"
        if not m["content"].strip():
            return f"messages.{j}.content: must be a non-empty string"
    if row["messages"][-1]["role"] != "assistant":
        return "messages: the last turn must be the assistant's (the answer trained on)"
    return None


def build_replay_mix(cfg: ReplayMixConfig) -> DatasetManifest:
    """SFT rows sampled from local chat datasets: up to `cap` rows per source, seeded, source order kept."""
    refs, _, _ = references(cfg)
    rows, stats, files = [], {}, []
    for src in cfg.sources:
        pool = read_chat_rows(src.path)
        k = len(pool) if src.cap is None else min(src.cap, len(pool))
        picked = sorted(random.Random(f"{cfg.seed}:{src.name}").sample(range(len(pool)), k))
        rows += [{"id": f"{src.name}:{i + 1}", "messages": served(pool[i]["messages"], cfg.system_prompt)} for i in picked]
        stats |= {f"{src.name}.available": len(pool), f"{src.name}.taken": k}
        files.append(SourceFile(role="replay", path=str(src.path), sha256=file_sha256(src.path)))
    return _finish("replay_mix", "sft", cfg, rows, refs, files, stats)


def build_synthetic_verified(cfg: SyntheticVerifiedConfig) -> DatasetManifest:
    """SFT rows of generated tasks answered by reference answers that the eval checker accepts, or
    (rows='items') the tasks as eval items: the prompt rows of rejection-sampling fine-tuning.

    Generated items whose prompt would hit the leak audit are redrawn (this is generated data, so
    steering clear of the eval and holdout prompts is the point); the audit still runs on the result.
    """
    refs, _, _ = references(cfg)
    index = ReferenceIndex(refs, cfg.ngram)

    def leaks(item: Item) -> bool:
        return index.match(0, prompt_text([m.model_dump() for m in item.messages])) is not None

    rows, stats = [], {}
    for family in FAMILIES:
        if family not in cfg.counts:
            continue
        tasks = generate(family, cfg.counts[family], cfg.seed, exclude=leaks)
        for t in tasks:
            if not check(t.item, t.reference):  # the verification that gives the builder its name
                raise DatasetError(f"synthetic_verified: the checker rejects the reference answer of {t.item.id}")
            if cfg.rows == "items":
                rows.append(t.item.model_dump(mode="json", exclude_defaults=True))
                continue
            turns = served([m.model_dump() for m in t.item.messages], cfg.system_prompt)
            rows.append({"id": t.item.id, "messages": [*turns, {"role": "assistant", "content": t.reference}]})
        stats[family] = len(tasks)
    return _finish("synthetic_verified", cfg.rows, cfg, rows, refs, [], stats)


def build_verified_pool(cfg: VerifiedPoolConfig) -> DatasetManifest:
    """RFT prompt items drawn from the lab's own verified pool (not from any eval file: the pool is its own
    [[data]] file), leak-audited like every dataset against the holdouts and every eval suite; an item that leaks
    is dropped and recorded in the manifest. The manifest's config names the verifier suite, whose scorer is RFT's reward."""
    refs, _, _ = references(cfg)
    items = read_items_file(cfg.source.path)
    rng = random.Random(cfg.seed)
    picked = items if cfg.n is None or cfg.n >= len(items) else rng.sample(items, cfg.n)
    rows = [item.model_dump(mode="json", exclude_defaults=True) for item in picked]
    source = SourceFile(role=f"data:{cfg.source.name}", path=str(cfg.source.path), sha256=file_sha256(cfg.source.path))
    return _finish("verified_pool", "items", cfg, rows, refs, [source], {"pool": len(items), "drawn": len(rows)})


def read_items_file(path: Path) -> list[Item]:
    """A verified pool's items, all or nothing: a line that is no eval item raises DatasetError naming it."""
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(Item.model_validate_json(line))
        except ValidationError as err:
            raise DatasetError(f"{path}:{n}: not an eval item ({err.errors()[0]['msg']})") from None
    if not items:
        raise DatasetError(f"{path}: no items")
    return items


def _weighted(rows: list[dict], weight: float, rng: random.Random) -> list[dict]:
    whole = math.floor(weight)
    extra = round((weight - whole) * len(rows))
    return rows * whole + [rows[i] for i in sorted(rng.sample(range(len(rows)), extra))]


def _mix_kind(cfg: MixConfig, manifests: list[DatasetManifest]) -> RowKind:
    kinds = {m.row_kind for m in manifests}
    if len(kinds) != 1:
        raise DatasetError(f"mix: parts mix row kinds {sorted(kinds)}; SFT rows and preference pairs cannot be mixed")
    kind = kinds.pop()
    if not any(p.kl_only for p in cfg.parts):
        return kind
    if kind != "sft":
        raise DatasetError(f"mix: kl_only parts need SFT rows to build KL-CE rows, got {kind} rows")
    return "klce"


def build_mix(cfg: MixConfig) -> DatasetManifest:
    """A weighted concatenation of built datasets of one row kind, shuffled with the seed; with kl_only
    parts, KL-CE rows whose replay rows (kl_only true) only anchor the model to its parent."""
    refs, _, _ = references(cfg)
    manifests = [read_manifest(p.path) for p in cfg.parts]
    kind = _mix_kind(cfg, manifests)
    rng = random.Random(cfg.seed)
    rows, stats = [], {}
    for part in cfg.parts:
        part_rows = [value for _, value in read_values(part.path)]
        if kind == "klce":
            part_rows = [r | {"kl_only": part.kl_only} for r in part_rows]
        taken = _weighted(part_rows, part.weight, rng)
        rows += taken
        stats[Path(part.path).stem] = len(taken)
    rng.shuffle(rows)
    files = [SourceFile(role="dataset", path=str(p.path), sha256=m.sha256) for p, m in zip(cfg.parts, manifests, strict=True)]
    return _finish("mix", kind, cfg, rows, refs, files, stats)


def record_dataset(notebook: Notebook, manifest: DatasetManifest, *, session: str | None = None,
                   parents: list[int] | None = None, job_key: str | None = None) -> Artifact:
    """Record a built dataset as a notebook artifact; the manifest is its recipe. Returns the Artifact."""
    return notebook.add_artifact(
        kind="dataset", name=Path(manifest.path).stem, path=manifest.path, sha256=manifest.sha256,
        parents=parents, recipe=manifest.model_dump(mode="json"), job_key=job_key, session=session,
    )


BUILDERS = {
    "winner_sft": (WinnerSFTConfig, build_winner_sft),
    "battle_pairs": (BattlePairsConfig, build_battle_pairs),
    "replay_mix": (ReplayMixConfig, build_replay_mix),
    "synthetic_verified": (SyntheticVerifiedConfig, build_synthetic_verified),
    "verified_pool": (VerifiedPoolConfig, build_verified_pool),
    "mix": (MixConfig, build_mix),
}


def _summary(_: BaseModel, manifest: DatasetManifest) -> str:
    return (f"{manifest.path}: {manifest.rows} rows, {manifest.tokens} tokens, sha256 {manifest.sha256}, audited "
            f"({manifest.audit.rows_checked} prompts vs {sum(manifest.audit.references.values())} references, "
            f"{manifest.leak_dropped} dropped)")


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.data.datasets BUILDER CONFIG.json`: build one audited dataset (exit 2 on bad input)."""
    from core.entry import run_main

    return run_main("python -m tools.data.datasets", BUILDERS, argv, bad_input=(DatasetError, FeedbackError, OSError),
                    summary=_summary)


if __name__ == "__main__":
    sys.exit(main())
