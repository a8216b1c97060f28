"""The building blocks composed the way the agent drives them, through real jobs and one notebook.

feedback -> sealed split -> audited winner-SFT dataset -> bars registered -> incumbent evaluated K
times (noise floor) -> SFT job -> candidate eval job -> compare at served decoding -> verify chain.
Every job runs as a real subprocess of submitit's local executor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core import tiny
from evals import bars, noise, synthetic
from evals.compare import compare
from evals.decoding import Decoding
from evals.job import EvalJobConfig, SuiteSpec
from evals.job import run as run_eval
from evals.records import record_result
from memory.notebook import Notebook
from tools.data.datasets import WinnerSFTConfig, build_winner_sft, record_dataset
from tools.data.splits import SplitConfig, ingest_feedback
from tools.jobs.executor import ExecutorSection
from tools.jobs.launcher import Launcher, Resources
from trainers import sft
from trainers.common import weights_sha256

SYSTEM = "You are a careful assistant."
SESSION = "s1"


def _feedback(path: Path) -> list[str]:
    """40 digit-sum battles: the correct worked answer is preferred; returns the battle prompts."""
    tasks = synthetic.generate("digit_sum", 40, seed=5)
    lines = []
    for i, task in enumerate(tasks):
        right, wrong = task.reference, f"I think it is {int(task.item.gold) + 3}.\nAnswer: {int(task.item.gold) + 3}"
        own, other, vote = (wrong, right, "other") if i % 8 == 0 else (right, wrong, "own")
        lines.append(json.dumps({"id": f"b{i:03d}", "messages": [m.model_dump() for m in task.item.messages],
                                 "own": own, "other": other, "vote": vote if i % 10 else "tie"}))
    path.write_text("\n".join(lines) + "\n")
    return [t.item.messages[-1].content for t in tasks]


@pytest.mark.slow
def test_feedback_to_promotion_verdict_through_real_jobs(tmp_path: Path):
    torch.set_num_threads(1)
    tok = tiny.build_tokenizer(tmp_path / "tokenizer")
    parent = tiny.build_model("llama", tok, tmp_path / "parent", seed=0)
    lab = tmp_path / "lab"
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.05, planner="playbook",
                    executor="local", config={})
    prompts = _feedback(tmp_path / "feedback.jsonl")

    # Data: split, eval suite kept apart from every battle prompt, audited SFT set.
    split_path, split = ingest_feedback(nb, tmp_path / "feedback.jsonl", SplitConfig(dev_fraction=0.2, sealed_fraction=0.1),
                                        lab / "splits", session=SESSION)
    items = [t.item for t in synthetic.generate("digit_sum", 12, seed=11,
                                                exclude=lambda it: it.messages[-1].content in prompts)]
    suite_file = tmp_path / "digits.jsonl"
    suite_file.write_text("".join(i.model_dump_json() + "\n" for i in items))
    manifest = build_winner_sft(WinnerSFTConfig(out=lab / "data" / "winner.jsonl", tokenizer=tok,
                                                feedback=tmp_path / "feedback.jsonl", split=split_path,
                                                eval_suites=[suite_file], system_prompt=SYSTEM))
    dataset = record_dataset(nb, manifest, session=SESSION)
    assert manifest.audit.passed and manifest.audit.references["dev"] > 0 and 0 < manifest.rows < 40  # holdouts and non-decisive battles are not trained on

    # Bars first, then the incumbent's K=3 replicates and its noise floor.
    (tmp_path / "bars.toml").write_text('[[bar]]\nsuite = "digits"\nmetric = "correct"\n'
                                        'rule = "delta >= -1.0 * noise_floor"\n')
    registered = bars.register(nb, SESSION, bars.load(tmp_path / "bars.toml").spec())
    served = Decoding(system_prompt=SYSTEM, temperature=1.0, top_p=0.95, max_new_tokens=12, stop_token_ids=(3,))
    launcher = Launcher.from_section(nb, SESSION, ExecutorSection(kind="local", time_limit_min=10), tmp_path / "jobs")
    suites = (SuiteSpec(name="digits", scorer="synthetic", items_path=suite_file),)
    incumbent = nb.add_artifact(kind="checkpoint", name="parent", path=str(parent), sha256=weights_sha256(parent),
                                session=SESSION)
    inc_job = launcher.submit("eval", run_eval, EvalJobConfig(checkpoint=parent, decoding=served, suites=suites,
                                                              replicates=3, output_dir=tmp_path / "ev-parent"),
                              Resources(time_limit_min=10))
    floors = noise.calibrate(nb, SESSION, record_result(nb, SESSION, incumbent.id, inc_job.result(timeout_s=300),
                                                        job_key=inc_job.key))
    assert {f.metric for f in floors} >= {"correct"} and all(f.k == 3 for f in floors)

    # Train a candidate on the audited set, evaluate it at the served decoding, compare.
    train_job = launcher.submit("sft", sft.train, sft.SFTConfig(
        model_path=parent, data_path=Path(manifest.path), output_dir=tmp_path / "runs" / "sft1", system_prompt=SYSTEM,
        steps=6, lr=3e-3, batch_size=8, micro_batch_size=8), Resources(time_limit_min=10, model="tiny-llama"))
    trained = train_job.result(timeout_s=300)
    assert trained.steps == 6 and trained.data_sha256 == manifest.sha256
    candidate = nb.add_artifact(kind="checkpoint", name="sft1", path=str(trained.model_dir),
                                sha256=weights_sha256(trained.model_dir), parents=[incumbent.id, dataset.id],
                                recipe={"trainer": "sft"}, job_key=train_job.key, session=SESSION)
    cand_job = launcher.submit("eval", run_eval, EvalJobConfig(checkpoint=trained.model_dir, decoding=served,
                                                               suites=suites, output_dir=tmp_path / "ev-sft1"),
                               Resources(time_limit_min=10))
    record_result(nb, SESSION, candidate.id, cand_job.result(timeout_s=300), job_key=cand_job.key)

    greedy = Decoding(system_prompt=SYSTEM, max_new_tokens=12, stop_token_ids=(3,))
    refused = compare(nb, SESSION, candidate.id, incumbent.id, registered.id, greedy)
    assert refused.refused  # no eval at that decoding: the bars cannot be applied to it
    verdict = compare(nb, SESSION, candidate.id, incumbent.id, registered.id, served)
    assert not verdict.refused and len(verdict.verdicts) == 1 and verdict.verdicts[0].n == len(items)
    assert verdict.cleared == verdict.verdicts[0].holds

    # The notebook tells the whole story, and it verifies.
    ledger = nb.ledger(SESSION)
    assert ledger.reserved_gpuh == 0 and 0 < ledger.spent_gpuh < 0.1
    assert [j.state for j in nb.jobs(SESSION)] == ["completed"] * 3
    kinds = [d.kind for d in nb.decisions(SESSION)]
    assert kinds.index("register_bars") < kinds.index("launch") and kinds.count("launch") == 3
    assert kinds[-1] in ("promote", "reject") and "refuse" in kinds
    assert nb.comparisons(SESSION)[0].candidate == candidate.id
    assert nb.verify().ok
    assert split.sha256 == nb.latest_split().sha256
