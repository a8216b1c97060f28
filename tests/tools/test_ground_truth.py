"""The ground truth ([truth] of lab.toml) and the base model's license, without a session: the table and its
refusals, where a license is read from, the card's and the report's sections (every number found in the
record its reference names), and the planner's view, which a truth record leaves byte-for-byte unchanged.

The real job (the toy world's scorer, through the launcher) is tested in tests/world/test_ground_truth.py.
Everything here is a notebook written through its API in a temporary directory: well under a second per
test, but for the one CLI run (a fresh interpreter).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from agent import toolbox
from agent.config import LabConfigError, base_license, front_matter_license, load_lab_config
from agent.graph import Runtime, _usable
from agent.planners import ToolCall
from agent.planners.llm import LLMPlanner
from agent.summary import summarize
from evals.decoding import Decoding
from memory.notebook import Notebook
from memory.records import TruthPayload
from memory.report import write_report
from tools.nomination import card

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
from hostile_kit import LAB_TOML, REPO, make_lab  # noqa: E402

SESSION = "s1"
TRUTH = '\n[truth]\nkind = "world"\n'


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    lab = make_lab(tmp_path)
    (lab / "world").mkdir()
    (lab / "world" / "world.json").write_text("{}")  # what a world build leaves: the scorer's world is here
    return lab


# ---- lab.toml ------------------------------------------------------------------------------------


def test_truth_table_loads_with_its_defaults_and_is_optional(lab: Path):
    assert load_lab_config(lab).truth is None
    (lab / "lab.toml").write_text(LAB_TOML + TRUTH)
    truth = load_lab_config(lab).truth
    assert (truth.kind, truth.n, truth.seed) == ("world", 300, 0)


@pytest.mark.parametrize(("table", "expected"), [
    ('kind = "oracle"', "truth.kind: Input should be 'world' (got 'oracle')"),
    ('kind = "world"\nn = 5', "truth.n: Input should be greater than or equal to 20 (got 5)"),
    ('kind = "world"\nn = "300"', "truth.n: Input should be a valid integer (got '300')"),
    ('kind = "world"\nseed = -1', "truth.seed: Input should be greater than or equal to 0 (got -1)"),
    ('kind = "world"\nsize = 3', "truth.size: unknown key"),
    ("n = 300", "truth.kind: required key is missing"),
])
def test_bad_truth_values_are_refused_naming_the_key(lab: Path, table: str, expected: str):
    (lab / "lab.toml").write_text(f"{LAB_TOML}\n[truth]\n{table}\n")
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert str(err.value).startswith(f"{lab / 'lab.toml'}: 1 problem(s):") and expected in str(err.value)


def test_a_world_scorer_without_a_world_is_refused_at_the_cli_with_exit_2(lab: Path):
    (lab / "world" / "world.json").unlink()
    (lab / "lab.toml").write_text(LAB_TOML + TRUTH)
    run = subprocess.run([sys.executable, "run_agent.py", "--lab", str(lab), "--budget", "1gpuh"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"truth: kind = 'world' scores in the toy world built in this lab directory, and {lab}/world/world.json " \
           "is not there" in run.stderr
    assert not (lab / "notebook.db").exists()


# ---- the base model's license ----------------------------------------------------------------------


@pytest.mark.parametrize(("readme", "expected"), [
    ("---\nlicense: apache-2.0\nlanguage: en\n---\n# Model\n", "apache-2.0"),
    ("---\nlanguage: en\nlicense: 'llama3.1'\n---\n", "llama3.1"),
    ("---\nlicense:\n- mit\n- cc-by-4.0\ntags:\n- chat\n---\n", "mit, cc-by-4.0"),
    ("# Model\n\nlicense: mit\n", None),                        # not front matter
    ("---\nlanguage: en\n---\nlicense: mit\n", None),          # after the front matter
    ("---\nlicense_name: custom\n---\n", None),
])
def test_the_license_is_read_from_the_readme_front_matter(readme: str, expected: str | None):
    assert front_matter_license(readme) == expected


def test_license_sources_in_order_lab_toml_then_readme_then_not_declared(lab: Path):
    model = load_lab_config(lab).model
    assert base_license(model) == (None, "not declared")
    (lab / "models" / "base" / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    readme = lab / "models" / "base" / "README.md"
    assert base_license(load_lab_config(lab).model) == ("apache-2.0", f"{readme} front matter")
    (lab / "lab.toml").write_text(LAB_TOML.replace('base = "models/base"', 'base = "models/base"\nlicense = "mit"'))
    assert base_license(load_lab_config(lab).model) == ("mit", "lab.toml [model] license")
    (lab / "lab.toml").write_text(LAB_TOML.replace('base = "models/base"', 'base = "models/base"\nlicense = ""'))
    with pytest.raises(LabConfigError, match=r"model\.license: expected the base model's license as one line"):
        load_lab_config(lab)


# ---- a recorded session ----------------------------------------------------------------------------


def _truth_payload(nominee: int, parent: int) -> TruthPayload:
    return TruthPayload.model_validate({
        "artifact_id": nominee, "parent": parent, "scorer": "world", "job_key": "f" * 64, "n": 120, "seed": 0,
        "win_rate": 0.5625, "ci_low": 0.49, "ci_high": 0.635, "outcomes": {"win": 40, "tie": 50, "both_bad": 5, "loss": 25},
        "accuracy": 0.4417, "other_accuracy": 0.3333,
        "per_family": {"digit_sum": {"n": 70, "accuracy": 0.5, "other_accuracy": 0.4, "win_rate": 0.55},
                       "word_count": {"n": 50, "accuracy": 0.36, "other_accuracy": 0.24, "win_rate": 0.58}},
        "audit_passed": True, "audit_sha256": "a" * 64, "audit_references": {"feedback": 480, "eval:synthetic": 72}})


def _eval(nb: Notebook, artifact: int, values: list[float]) -> None:
    decoding = Decoding(system_prompt="Be brief.", stop_token_ids=(3,), max_new_tokens=16)
    nb.add_eval(session=SESSION, artifact_id=artifact, suite="digits", replicate=0,
                decoding=decoding.model_dump(mode="json"), decoding_sha256=decoding.fingerprint(), served=True,
                metrics={"correct": sum(values) / len(values)},
                items=[{"id": f"i{k}", "values": {"correct": v}} for k, v in enumerate(values)])


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Notebook, int, int]:
    """A session that nominated a candidate over its parent, as the tools record it (no jobs)."""
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session(SESSION, lab=str(tmp_path), budget_gpuh=5.0, reserve_gpuh=0.5, planner="openai",
                    executor="local", config={"lab": {"truth": {"kind": "world", "n": 120, "seed": 0}}})
    served = Decoding(system_prompt="Be brief.", stop_token_ids=(3,), max_new_tokens=16).model_dump(mode="json")
    parent = nb.add_artifact(kind="checkpoint", name="parent", path=str(tmp_path / "parent"), sha256="1" * 64,
                             session=SESSION, recipe={"role": "parent", "served_decoding": served,
                                                      "license": "apache-2.0",
                                                      "license_source": "lab.toml [model] license"}).id
    nominee = nb.add_artifact(kind="checkpoint", name="sft-a", path=str(tmp_path / "sft-a"), sha256="2" * 64,
                              parents=[parent], session=SESSION,
                              recipe={"trainer": "sft", "parent": parent, "served_decoding": served}).id
    _eval(nb, parent, [1.0, 0.0, 0.0, 1.0])
    _eval(nb, nominee, [1.0, 1.0, 0.0, 1.0])
    nb.record_decision(SESSION, "nominate", "nominee sft-a", {"artifact_id": nominee})
    yield nb, parent, nominee
    nb.close()


def _record_truth(nb: Notebook, parent: int, nominee: int) -> None:
    """The ground-truth step as tools/ground_truth.py leaves it: a call, its job attempt (on the reserve,
    declared 0; this one failed its first attempt and was settled at 0) and the `truth` decision."""
    call = nb.record_tool_call(SESSION, "ground_truth", {"artifact": nominee})
    nb.start_job("truth-key", session=SESSION, kind="truth", executor="local", resources={"nomination": True},
                 forecast_gpuh=0.0)
    nb.update_job("truth-key", 1, state="failed", failure_class="error", failure_detail="killed", gpu_hours=0.0)
    payload = _truth_payload(nominee, parent)
    nb.record_decision(SESSION, "truth", "ground truth of sft-a", payload)
    nb.finish_tool_call(call.id, "done", {"tool": "ground_truth", "status": "done", "data": {"artifact_id": nominee},
                                          "summary": f"win rate {payload.win_rate}"})


def _request(nb: Notebook) -> list[dict]:
    planner = LLMPlanner(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused"), "planner-1")
    return planner.messages(summarize(nb, SESSION), [])


def test_a_truth_record_leaves_the_summary_and_the_planners_request_unchanged(recorded):
    nb, parent, nominee = recorded
    before, request = summarize(nb, SESSION).model_dump_json(), _request(nb)
    _record_truth(nb, parent, nominee)
    assert nb.decisions(SESSION, kind="truth") and nb.verify().ok
    assert summarize(nb, SESSION).model_dump_json() == before
    assert _request(nb) == request
    text = json.dumps(request)
    assert "ground_truth" not in text and "0.5625" not in text and "truth" not in text
    # Nor can a planner ask for it: it is no planner tool, and a proposal of it is refused as unknown.
    assert "ground_truth" not in json.dumps(toolbox.schemas()) and "ground_truth" in toolbox.TOOLS
    rt = Runtime(ctx=None, planner=None, playbook=None, forecaster=None, reporter=None)
    reply = _usable(rt, summarize(nb, SESSION), ToolCall(tool="ground_truth", args={"artifact": nominee}, rationale=""))
    assert "unknown tool 'ground_truth'" in reply.reason


_REF = re.compile(r"<!-- nb (\w+):(\d+) (\S+) -->")
_TOKEN = re.compile(r"<!--.*?-->|(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", re.S)


def _resolve(nb: Notebook, table: str, ident: str, expr: str):
    """The value a reference names: a dotted path into the record, or sum(...) over a path with `*`."""
    i = int(ident)
    record = (nb.artifact(i) if table == "artifact" else next(d for d in nb.decisions() if d.seq == i)).model_dump(mode="json")
    fn, _, inner = expr.partition("(")
    values = [record]
    for part in (inner.rstrip(")") if inner else expr).split("."):
        values = [x for v in values for x in (v.values() if part == "*" else [v[part]])]
    return sum(values) if fn == "sum" else values[0]


def _numbers(section: str) -> list[tuple[str, re.Match | None]]:
    """Each number outside a code span (identifiers and the card's constants are code), with the reference
    right after it, if any."""
    tokens = list(_TOKEN.finditer(re.sub(r"`[^`\n]*`", "", section)))
    found = []
    for k, tok in enumerate(tokens):
        if not tok.group().startswith("<!--"):
            nxt = tokens[k + 1] if k + 1 < len(tokens) else None
            follows = nxt is not None and nxt.start() == tok.end()
            found.append((tok.group(), _REF.fullmatch(nxt.group()) if follows else None))
    return found


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_card_shows_the_truth_and_the_license_each_value_found_in_its_record(recorded):
    nb, parent, nominee = recorded
    _record_truth(nb, parent, nominee)
    text = card.render_card(nb, SESSION, nominee, parent, None, card.WeightsInfo(kind="full"))
    truth, license_text = _section(text, "Ground truth"), _section(text, "License")
    [seq] = [d.seq for d in nb.decisions(SESSION, kind="truth")]
    assert f"(decision `{seq}`, job `ffffffffffff`)" in truth and "against the parent `parent`" in truth
    assert f"0.5625<!-- nb decision:{seq} payload.win_rate -->" in truth
    assert f"n = 120<!-- nb decision:{seq} payload.n --> prompts" in truth
    assert f"| `word_count` | 50<!-- nb decision:{seq} payload.per_family.word_count.n --> |" in truth
    numbers = _numbers(truth)
    assert len(numbers) == 4 + 2 + 4 + 1 + 2 * 4  # win rate, its CI and n; accuracies; outcomes; audit; families
    for shown, reference in numbers:
        assert reference is not None, f"{shown} has no notebook reference"
        assert float(shown) == pytest.approx(_resolve(nb, *reference.groups()), abs=5e-5), reference.group()
    # The words that stand for recorded values carry their references too.
    assert f"passed<!-- nb decision:{seq} payload.audit_passed -->" in truth and _resolve(
        nb, "decision", str(seq), "payload.audit_passed") is True
    # Its interval reaches 0.5: the limitations say the nominee is not shown to beat the parent.
    assert (f"- by the ground truth the nominee is not shown to be better than the parent: true win rate "
            f"0.5625<!-- nb decision:{seq} payload.win_rate -->, interval 0.49<!-- nb decision:{seq} payload.ci_low -->"
            in _section(text, "Limitations"))
    for shown, expr in (("apache-2.0", "recipe.license"), ("lab.toml [model] license", "recipe.license_source")):
        assert f"`{shown}`<!-- nb artifact:{parent} {expr} -->" in license_text
        assert _resolve(nb, "artifact", str(parent), expr) == shown


def test_without_a_record_the_card_says_why(recorded):
    nb, parent, nominee = recorded
    text = card.render_card(nb, SESSION, nominee, parent, None, card.WeightsInfo(kind="full"))
    assert "declares the ground-truth scorer `world` (sample of `120` prompts), but no result is recorded for the " \
           "nominee: it was not run" in _section(text, "Ground truth")
    nb.record_tool_call(SESSION, "ground_truth", {"artifact": nominee})
    text = card.render_card(nb, SESSION, nominee, parent, None, card.WeightsInfo(kind="full"))
    assert re.search(r"but no result is recorded for the nominee: its tool call `\d+` ended `open`", text)


def test_a_parent_with_no_declared_license_says_so(tmp_path: Path):
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session(SESSION, lab=str(tmp_path), budget_gpuh=5.0, reserve_gpuh=0.5, planner="playbook",
                    executor="local", config={"lab": {}})
    served = Decoding(stop_token_ids=(3,)).model_dump(mode="json")
    parent = nb.add_artifact(kind="checkpoint", name="parent", path="p", sha256="1" * 64, session=SESSION,
                             recipe={"role": "parent", "served_decoding": served, "license": None,
                                     "license_source": "not declared"}).id
    _eval(nb, parent, [1.0, 0.0])
    text = card.render_card(nb, SESSION, parent, parent, None, card.WeightsInfo(kind="full"))
    assert f"The base model's license: not declared<!-- nb artifact:{parent} recipe.license -->" in text
    assert "The lab declares no ground-truth scorer (`[truth]` in lab.toml), so none was measured." in text
    nb.close()


def test_the_report_shows_the_truth_with_its_decision(recorded, tmp_path: Path):
    nb, parent, nominee = recorded
    _record_truth(nb, parent, nominee)
    [seq] = [d.seq for d in nb.decisions(SESSION, kind="truth")]
    _, out = write_report(nb.path, SESSION, tmp_path / "report.html")
    html = out.read_text()
    assert f'Ground truth (world, <a href="#decision-{seq}">decision {seq}</a>; never shown to the planner)' in html
    assert "true win rate <b>0.5625</b> (95% CI 0.49 to 0.635), n = 120" in html
    assert "<td>word_count</td><td>50</td><td>0.36</td><td>0.24</td><td>0.58</td>" in html
