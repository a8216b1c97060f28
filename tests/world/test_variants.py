"""World variants (issue 33): each builds deterministically and has its defining property, measured with the oracle
at the test size; the default is the world as before; a reduced variants benchmark runs as `make test`'s.

The variants are built from the test suite's shared world (seed 0, the default) through `build(..., reuse=)`, into
the layout the benchmark reads (WORK/world-0, WORK/VARIANT/world-0), so the reduced benchmark finds them built.
harmful-arms and strong-parent change what training does, so their properties are read from that benchmark's real
sessions (the short protocol's SFT and DPO arms, judged on the truth sample): a test of its own would train the
same arms again.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from agent.config import load_lab_config
from agent.inputs import _split_config
from agent.planners.policy import VERSION
from evals import synthetic
from evals.compare import _OPS
from evals.decoding import Decoding
from evals.judge import judged_prompt, parse_verdict
from evals.records import served_draws
from evals.types import Item
from memory.notebook import Notebook
from memory.state import fold
from tools.data.splits import split_file
from tools.world import build as world
from tools.world import oracle, variants
from tools.world.build import MANIFEST, cached
from tools.world.tasks import hash_seed
from tools.world.testing import session_world
from tools.world.truth import draw_sample

REPO = Path(__file__).resolve().parents[2]
CHEAP = ("noisy-judge", "small-holdout", "harmful-arms", "misleading-screens")  # no parent of their own to train
BENCHED = ("harmful-arms", "strong-parent")
TRUTH_N = 600  # the reduced benchmark's truth sample: a CI half-width of about 2-3 points at the test size


def _build(work: Path, name: str, default: Path) -> Path:
    lab = work / name / "world-0"
    world.build(lab, seed=0, size="test", variant=name, reuse=default)
    return lab


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """WORK/world-0 (a copy of the shared default world) and WORK/VARIANT/world-0 for every variant."""
    work = tmp_path_factory.mktemp("variants")
    shutil.copytree(session_world(tmp_path_factory), work / "world-0")
    for name in variants.VARIANT_NAMES[1:]:
        _build(work, name, work / "world-0")
    return work


def _files(lab: Path) -> dict[str, str]:
    return json.loads((lab / "world" / MANIFEST).read_text())["files"]


def test_the_default_variant_is_the_world_as_it_was(work):
    default = work / "world-0"
    assert cached(default, 0, "test") is not None and cached(default, 0, "test", variant="default") is not None
    # the default's manifest and spec name no variant: their bytes are those of the builds made before variants
    assert "variant" not in json.loads((default / "world" / MANIFEST).read_text())
    assert "variant" not in json.loads((default / "world" / "world.json").read_text())
    assert "variant" not in (default / "lab.toml").read_text()


@pytest.mark.slow
def test_each_variant_is_its_own_cached_world_and_builds_to_the_same_files(work, tmp_path):
    default = _files(work / "world-0")
    for name in variants.VARIANT_NAMES[1:]:
        lab = work / name / "world-0"
        assert cached(lab, 0, "test", variant=name) is not None
        assert cached(lab, 0, "test") is None  # the variant is part of the cache key
        assert json.loads((lab / "world" / MANIFEST).read_text())["variant"] == name
        assert world.load_spec(lab).variant == name
        assert _files(lab) != default and _files(lab)["world/models/base/model.safetensors"] == \
            default["world/models/base/model.safetensors"]  # the same base, a different world
    # Same seed and variant, same files. strong-parent's stage 1 is the default build's own trainer, whose bytes
    # test_build.py's rebuild pins; a variant built without `reuse` was checked by hand to give the same files as
    # one sharing the default's parts (noisy-judge, seed 0: only the unhashed weights_manifest.json differ), a
    # whole world build (~20 s) this test leaves out.
    for name in CHEAP:
        again = _build(tmp_path, name, work / "world-0")
        assert _files(again) == _files(work / name / "world-0"), name


def test_an_unknown_variant_exits_2_with_one_message_and_writes_nothing(tmp_path):
    lab = tmp_path / "lab"
    done = subprocess.run([sys.executable, "run_agent.py", "world", "build", "--lab", str(lab), "--size", "test",
                           "--variant", "hard-mode"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "hard-mode" in lines[0] and "noisy-judge" in lines[0], done.stderr
    assert not lab.exists()


def test_noisy_judge_votes_30_percent_wrong_and_10_percent_ties(work):
    lab = work / "noisy-judge" / "world-0"
    noise = world.load_spec(lab).oracle_noise
    assert (noise.wrong_rate, noise.tie_rate) == (0.30, 0.10)
    # every vote of its feedback is the oracle's at that noise (and differs from the default world's somewhere)
    rows = [json.loads(line) for line in (lab / world.FEEDBACK).read_text().splitlines()]
    default = {r["id"]: r["vote"] for r in map(json.loads, (work / "world-0" / world.FEEDBACK).read_text().splitlines())}
    firsts = random.Random(hash_seed(0, "battles-gen") % 2**31)  # the build's draw of which side is shown first
    own_first = {f"b-{t.id.replace('/', '-')}": firsts.random() < 0.5
                 for t in world.draw_pools(0, world.SIZES["test"]).battles}
    for row in rows:
        prompt = judged_prompt(Item(id=row["id"], messages=row["messages"]))
        assert row["vote"] == world.vote(prompt, row["own"], row["other"], own_first[row["id"]], noise), row["id"]
    assert any(default[r["id"]] != r["vote"] for r in rows)
    # the rates, measured on 2000 fresh world prompts whose true verdict is decisive (a correct worked answer
    # against an empty one): within 3.5 binomial standard errors of 30% wrong and 10% tie
    tasks, _ = draw_sample(lab, 2000, 7)
    verdicts = [parse_verdict(oracle.judge_with(p, t.reference, "", noise))
                for t in tasks for p in [judged_prompt(t.item("noise"))]]
    wrong, tie = verdicts.count("B") / len(verdicts), verdicts.count("tie") / len(verdicts)
    assert abs(wrong - 0.30) < 0.036 and abs(tie - 0.10) < 0.024, (wrong, tie)
    stated = [parse_verdict(oracle.judge(judged_prompt(t.item("noise")), t.reference, "")) for t in tasks]
    assert stated.count("B") / len(stated) < 0.15  # the default world's voters are not this careless


def test_small_holdout_has_at_most_60_dev_battles_and_a_reserve(work):
    lab = work / "small-holdout" / "world-0"
    _, split = split_file(lab / world.FEEDBACK, _split_config(load_lab_config(lab)))  # the split ingest makes
    assert 0 < sum(v == "dev" for v in split.assignment.values()) <= 60
    # its reserve: more holdout prompts (read only by a reserve look), taken from what would have trained
    reserve = variants.variant("small-holdout").reserve_fraction
    assert reserve > 0 and len(split.ids("reserve")) == int(len(split.assignment) * reserve + 0.5)
    _, default = split_file(work / "world-0" / world.FEEDBACK, _split_config(load_lab_config(work / "world-0")))
    assert "reserve" not in default.counts and all(variants.variant(n).reserve_fraction == 0
                                                   for n in variants.VARIANT_NAMES if n != "small-holdout")
    # the demo size's 480 battles: the share is cut from 0.3 (144 battles) to fit
    v = variants.variant("small-holdout")
    assert variants.dev_fraction(v, 480, 0.3) * 480 <= 50 and variants.dev_fraction(v, 64, 0.3) == 0.3


def test_harmful_arms_sets_the_harmful_rates_in_the_labs_own_recipe(work):
    config = load_lab_config(work / "harmful-arms" / "world-0")
    harmful = variants.variant("harmful-arms").train_lr
    assert set(harmful) == {"dpo", "klce"} and min(harmful.values()) >= 50 * config.train.lr
    assert (config.train.dpo.lr, config.train.klce.lr) == (harmful["dpo"], harmful["klce"])
    assert config.train.sft.lr is None and config.train.rft.lr is None  # the other half keep [train]'s


def test_misleading_screens_rank_a_truly_better_answerer_below_the_parent(work):
    from evals.generate import generate, load

    lab = work / "misleading-screens" / "world-0"
    suite = [Item.model_validate_json(line) for line in (lab / world.SYNTHETIC_SUITE).read_text().splitlines()]
    gold = {i.id: i.gold for i in map(Item.model_validate_json,
                                      (work / "world-0" / world.SYNTHETIC_SUITE).read_text().splitlines())}
    assert [i.id for i in suite] == list(gold) and any(i.gold != gold[i.id] for i in suite)  # relabelled
    # the parent's own answers at another sampling seed, and the worked references (every answer right and clean)
    decoding = world.served_decoding(lab / world.TOKENIZER, world.SIZES["test"])
    parent = [c.text for c in generate(load(lab / world.PARENT, device="cpu"), suite, decoding, seed=11)]
    tasks = {t.item("synthetic").id: t for t in world.draw_pools(0, world.SIZES["test"]).synthetic}
    references = [tasks[i.id].reference for i in suite]
    screen = [sum(synthetic.check(i, a) for i, a in zip(suite, answers, strict=True)) for answers in (parent, references)]
    points = {"A": 1.0, "B": 0.0, "tie": 0.5, "both_bad": 0.5}
    truth = sum(points[oracle.true_verdict(judged_prompt(i), r, p)[0]] for i, r, p in zip(suite, references, parent, strict=True))
    assert truth / len(suite) > 0.5  # the references are truly better than the parent ...
    assert screen[1] < screen[0], screen  # ... and the screen ranks them below it


@pytest.fixture(scope="module")
def bench(work) -> dict:
    out = work / "out.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/decision_quality.py"), "--variants", ",".join(BENCHED),
                           "--seeds", "1", "--first-seed", "0", "--size", "test", "--protocol", "short", "--budget", "5000gpuh",
                           "--truth-n", str(TRUTH_N), "--work", str(work), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


PLAYBOOK_KEYS = {"sessions", "nominee_truly_worse_sessions", "false_promotion_share",
                 "truly_better_share_where_oracle_better", "oracle_gain_capture", "parent_kept_share", "truth_resolution"}


@pytest.mark.slow
def test_the_reduced_variants_benchmark_writes_every_figure(bench):
    assert set(bench["variants"]) == set(BENCHED)
    for name, result in bench["variants"].items():
        assert set(result["summary"]) == {"playbook", "greedy", "last_arm", "oracle_best"}
        play = result["summary"]["playbook"]
        assert PLAYBOOK_KEYS <= set(play), PLAYBOOK_KEYS - set(play)
        # A world whose feedback split the agent refuses opens no session and the next seed is taken: strong-parent's
        # seed-0 parent is trained in the build, and on another CPU its feedback's sealed split fell past the skew bound.
        assert play["sessions"] == 1 and len(result["seeds"]) == 1, result["refused"]
        assert all(r["seed"] < result["seeds"][0] and all("split" in p for p in r["problems"])
                   for r in result["refused"]), result["refused"]
        assert play["truth_resolution"]["truth_n"] == TRUTH_N and 0 < play["truth_resolution"]["ci_half_width_max"] < 0.05
        session = result["sessions"][0]
        assert session["replay_reproduced"] and session["feedback"]["variant"] == name
        kept = session["policies"]["playbook"]["nominee"] == session["parent"]
        assert play["parent_kept_share"] == float(kept)
        reach = result["oracle_reach"]  # read from the session's notebook: the rules it ran, where it lost the best
        assert reach["policy_versions"] == [VERSION]
        lost = reach["oracle_best_never_compared_seeds"] + reach["oracle_best_compared_not_nominated_seeds"]
        assert set(lost) <= set(reach["oracle_better_seeds"]) <= set(result["seeds"])
        assert set(reach["oracle_best_never_looked_at_seeds"]) <= set(reach["oracle_best_never_compared_seeds"])
        assert set(reach["oracle_best_failed_bars"]) == {str(x) for x in reach["oracle_best_compared_not_nominated_seeds"]}
        goals = {g["goal"] for g in result["goals"]}
        assert {"nominee_truly_worse_sessions", "false_promotion_share", "truly_better_share_where_oracle_better",
                "oracle_gain_capture"} <= goals and (("parent_kept_share" in goals) == (name == "strong-parent"))


def check_looks_and_audit(nb: Notebook, session: str) -> dict[str, int]:
    """Issue 41's rules re-derived from a session's notebook: every comparison under sequential bars is read at a
    `decided` look preceded by its unresolved ones (look j after look j-1 left it open, on the candidate's served draws
    0 .. j-1 of the judged suite; a reserve look, the last registered one, on draws 0 .. j-2 and both sides' first
    looks at the reserve's prompts), its recorded p-value is min p_i / w_i recomputed here from the eval rows, an
    unresolved look spends no p-value; an `audit` finding is recorded exactly when every p bar held and a guard not yet
    flagged failed at its registered margin, and from then on that guard reads the wider margin. Returns counts."""
    state = fold(nb, session)
    spec = state.bars.spec
    assert spec.looks > 1 and spec.audit_margin is not None  # the world's bars register both
    weights = spec.look_weights()
    counts = {"comparisons": 0, "looks": len(state.looks), "unresolved": 0, "findings": len(state.findings),
              "reserve_looks": 0}
    for v in state.verdicts:
        counts["comparisons"] += 1
        taken = [x for x in state.looks if (x.payload.candidate, x.payload.incumbent) == (v.candidate, v.incumbent)
                 and x.seq < v.seq]
        mine = [x.payload for x in taken]
        assert mine and mine[-1].outcome == "decided" and [x.look for x in mine] == list(range(1, len(mine) + 1))
        assert all(x.outcome == "continue" for x in mine[:-1]) and len(mine) <= spec.looks
        counts["unresolved"] += len(mine) - 1
        p_bar = next(b for b in v.bars if b.bar.statistic == "p")
        rule = p_bar.bar
        first = nb.evals(artifact_id=v.candidate, suite=rule.suite, session=session)[0]
        draws = served_draws(nb, session, v.candidate, rule.suite, first.decoding_sha256)
        if Decoding.model_validate(first.decoding).greedy:  # a greedy look is exact: every draw is draw 0
            draws = dict.fromkeys(range(spec.looks), draws[0])
        inc = next(e for e in nb.evals(artifact_id=v.incumbent, suite=rule.suite, session=session) if e.replicate == 0)
        inc_values = inc.values(rule.metric)
        ids = sorted(inc_values)
        ps = []
        for j, look in enumerate(mine, start=1):
            k = j - 1 if look.reserve is not None else j
            mean = [sum(draws[x].values(rule.metric)[i] for x in range(k)) / k for i in ids]
            base = [inc_values[i] for i in ids]
            if look.reserve is not None:  # the reserve look: the last registered, both sides' first reserve looks
                assert j == spec.looks == len(mine) and look.n == len(ids) + look.reserve
                reserve_suite = f"{rule.suite}@reserve"
                cand_r = next(e for e in nb.evals(artifact_id=v.candidate, suite=reserve_suite, session=session)
                              if e.served and e.replicate == 0).values(rule.metric)
                inc_r = next(e for e in nb.evals(artifact_id=v.incumbent, suite=reserve_suite, session=session)
                             if e.served and e.replicate == 0).values(rule.metric)
                assert sorted(cand_r) == sorted(inc_r) and len(inc_r) == look.reserve and not set(inc_r) & set(ids)
                mean += [cand_r[i] for i in sorted(inc_r)]
                base += [inc_r[i] for i in sorted(inc_r)]
                counts["reserve_looks"] += 1
            ps.append(scipy_stats.ttest_rel(mean, base, alternative="greater").pvalue / weights[j - 1])
        assert p_bar.raw_p == pytest.approx(min(1.0, min(ps)), rel=1e-9, abs=1e-12)
        start = taken[0].seq
        for b in v.bars:
            allows_loss = b.bar.value < 0 if b.bar.op in (">=", ">") else b.bar.value > 0
            if b.bar.statistic == "p" or not b.bar.in_noise_units or not allows_loss:
                continue
            base = b.bar.value * b.floor
            before = [f for f in state.findings if f.payload.suite == b.bar.suite and f.seq < start]
            here = [f for f in state.findings if f.payload.suite == b.bar.suite and start < f.seq < v.seq]
            assert b.threshold == pytest.approx(base * spec.audit_margin if before or here else base)
            if here:  # flagged by this comparison: the judge held, the guard failed at its registered margin
                assert here[0].payload.candidate == v.candidate and p_bar.holds and not _OPS[b.bar.op](b.value, base)
            elif not before:  # not flagged: no finding was due
                assert not (p_bar.holds and not _OPS[b.bar.op](b.value, base))
    assert state.p_family.spent == counts["comparisons"] * len(state.bars.p_rules)  # unresolved looks spent nothing
    return counts


@pytest.mark.slow
def test_the_sessions_read_every_comparison_by_the_sequential_rule_and_the_suite_audit(bench):
    seen = {}
    for name, result in bench["variants"].items():
        session = result["sessions"][0]
        with Notebook.open(Path(session["lab"]) / "notebook.db", readonly=True) as nb:
            seen[name] = check_looks_and_audit(nb, session["session"])
        assert seen[name]["comparisons"] >= 1, (name, seen[name])
    # harmful-arms: no rule lets a truly harmful arm through
    assert bench["variants"]["harmful-arms"]["summary"]["playbook"]["nominee_truly_worse_sessions"] == 0


@pytest.mark.slow
def test_harmful_arms_dpo_arm_truly_hurts_and_no_arm_beats_the_strong_parent_by_2_points(bench):
    harmful = bench["variants"]["harmful-arms"]["truth_table"]["candidates"]
    assert harmful["train:dpo"]["truly_worse"] == harmful["train:dpo"]["n"] == 1  # the harmful half (dpo of sft, dpo)
    assert harmful["train:dpo"]["mean_win_rate"] < 0.45
    strong = bench["variants"]["strong-parent"]["truth_table"]
    assert {"train:sft", "train:dpo"} <= set(strong["candidates"])
    assert strong["max_true_gain"] <= 0.02
