"""The generation engine and the eval job on tiny models built offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import submitit

from evals import battle_margin, reward_proxy, synthetic
from evals.decoding import Decoding
from evals.generate import answer_logprobs, generate, load
from evals.job import EvalJobConfig, EvalResult, SuiteSpec, run
from evals.types import Battle


def _items(item, n=6):
    return [item(f"p{i}", "what is " + "12 + 7 " * (i % 4 + 1) + "?") for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "nemotron_h"])
def test_batched_left_padding_matches_one_at_a_time(tiny_models, item, kind):
    loaded = load(tiny_models[kind])
    items = _items(item)
    dec = Decoding(max_new_tokens=10, system_prompt="Be brief.")
    batched = generate(loaded, items, dec, seed=0, batch_size=6)
    single = [generate(loaded, [it], dec, seed=0, batch_size=1)[0] for it in items]
    assert [c.text for c in batched] == [c.text for c in single]
    assert all(c.truncated and c.n_tokens == 10 for c in batched)  # untrained: never stops by itself


def test_static_cache_matches_dynamic(tiny_models, item):
    # The GPU fast path (static KV cache, bucketed widths) must produce the same greedy answers.
    loaded = load(tiny_models["llama"])
    items = _items(item)
    dec = Decoding(max_new_tokens=6)
    assert generate(loaded, items, dec, seed=0, static_cache=True) == generate(loaded, items, dec, seed=0)


def test_static_loop_sampled_and_stopped_match_generate(tiny_models, item):
    # The engine's own loop (several batches, a reused and a second captured shape, rows stopping at
    # different steps) against `generate`: sampled with repetition penalty, and greedy with a stop id.
    loaded = load(tiny_models["llama"])
    items = [item(f"q{i}", "tell me " + "more and more " * i) for i in range(7)]
    sampled = Decoding(max_new_tokens=8, temperature=0.8, top_p=0.9, repetition_penalty=1.3)
    fast = generate(loaded, items, sampled, seed=3, batch_size=3, static_cache=True)
    assert fast == generate(loaded, items, sampled, seed=3, batch_size=3)
    assert fast != generate(loaded, items, sampled, seed=4, batch_size=3, static_cache=True)  # really sampled
    free = generate(loaded, items, Decoding(max_new_tokens=10, repetition_penalty=1.2), seed=0)
    stop = loaded.tokenizer(free[0].text, add_special_tokens=False)["input_ids"][2]
    greedy = Decoding(max_new_tokens=10, repetition_penalty=1.2, stop_token_ids=(stop,))
    fast = generate(loaded, items, greedy, seed=0, batch_size=3, static_cache=True)
    assert fast == generate(loaded, items, greedy, seed=0, batch_size=3) and fast[0].stopped


def test_stop_ids_cut_and_count(tiny_models, item):
    loaded = load(tiny_models["llama"])
    it = _items(item, 1)
    free = generate(loaded, it, Decoding(max_new_tokens=12), seed=0)[0]
    tokens = loaded.tokenizer(free.text, add_special_tokens=False)["input_ids"]
    stop = tokens[3]
    stopped = generate(loaded, it, Decoding(max_new_tokens=12, stop_token_ids=(stop,)), seed=0)[0]
    assert stopped.stopped and not stopped.truncated
    assert stopped.n_tokens <= 4 and free.text.startswith(stopped.text)


def test_sampling_seeds(tiny_models, item):
    loaded = load(tiny_models["llama"])
    items = _items(item)
    dec = Decoding(max_new_tokens=8, temperature=1.0, top_p=0.95)
    a, b, c = (generate(loaded, items, dec, seed=s) for s in (1, 1, 2))
    assert a == b and a != c


def test_answer_logprobs_batched_equals_single(tiny_models, item):
    loaded = load(tiny_models["llama"])
    items = _items(item, 3)
    answers = ["nineteen", "the answer is 38 because 12 + 7 is 19", "57"]
    dec = Decoding()
    batched = answer_logprobs(loaded, items, answers, dec, batch_size=3)
    single = [answer_logprobs(loaded, [i], [a], dec)[0] for i, a in zip(items, answers, strict=True)]
    assert batched == pytest.approx(single, abs=1e-4)
    assert all(v < 0 for v in batched)
    # Longer answers of a random model collect more negative log-probability.
    assert batched[1] < batched[0]


def _write_items(path, items):
    path.write_text("".join(i.model_dump_json() + "\n" for i in items))
    return path


def _battle_items(item, n=4):
    return [item(f"b{i}", f"say something about {i}",
                 battle=Battle(chosen=f"a fine answer number {i}", rejected="no " * (i + 1)))
            for i in range(n)]


def test_eval_job_runs_every_suite_on_one_load(tiny_models, item, tmp_path, monkeypatch):
    # A local judge module, importable by 'module:function' like the toy world's oracle.
    (tmp_path / "localjudge.py").write_text(
        "def prefer_longer(prompt, a, b):\n    return 'VERDICT: ' + ('A' if len(a) >= len(b) else 'B')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = _write_items(tmp_path / "plain.jsonl", _items(item))
    mcq = _write_items(tmp_path / "mcq.jsonl", [item(f"m{i}", "pick", gold="A", choices=("x", "y")) for i in range(3)])
    battles = _write_items(tmp_path / "battles.jsonl", _battle_items(item))
    synth = _write_items(tmp_path / "synth.jsonl", [t.item for t in synthetic.generate("digit_sum", 3, seed=0)])
    incumbent = tmp_path / "incumbent.jsonl"
    incumbent.write_text("".join(json.dumps({"item_id": f"b{i}", "text": "", "n_tokens": 1, "stopped": True,
                                             "truncated": False, "empty": True, "has_replacement_char": False})
                                 + "\n" for i in range(4)))
    cfg = EvalJobConfig(
        checkpoint=tiny_models["llama"], decoding=Decoding(max_new_tokens=8), replicates=3,
        output_dir=tmp_path / "out", reward_model=tiny_models["reward"],
        judge={"kind": "callable", "target": "localjudge:prefer_longer"},
        suites=[SuiteSpec(name="len", scorer="length_stop", items_path=plain),
                SuiteSpec(name="loops", scorer="loops", items_path=plain),
                SuiteSpec(name="mcq", scorer="mcq", items_path=mcq),
                SuiteSpec(name="synth", scorer="synthetic", items_path=synth),
                SuiteSpec(name="margin", scorer="battle_margin", items_path=battles),
                SuiteSpec(name="rm", scorer="reward_proxy", items_path=battles),
                SuiteSpec(name="judge", scorer="judge", items_path=battles, incumbent_completions=incumbent)],
    )
    result = run(cfg)
    assert EvalResult.model_validate_json((tmp_path / "out" / "result.json").read_text()) == result
    assert len(result.suites) == 7 * 3
    first = {r.suite: r for r in result.suites if r.replicate == 0}
    assert first["len"].metrics["truncated"] == 1.0 and first["len"].metrics["n_tokens"] == 8.0
    assert first["mcq"].metrics["n_unparsed"] == 3.0
    assert first["margin"].completions_path is None and first["margin"].metrics["n_margin"] == 4.0
    assert first["judge"].metrics["win_score"] == 1.0  # non-empty candidate beats the empty incumbent
    assert (tmp_path / "out" / "judgments-judge-r0.jsonl").is_file()
    resampled = [r for r in result.suites if r.replicate > 0]
    assert all(r.resampled for r in resampled)  # greedy: replicates are item resamples, not regenerations
    assert first["synth"].metrics["n_correct"] == 3.0
    assert result.generated_tokens == 8 * (6 + 6 + 3 + 3 + 4 + 4)
    # The reward proxy agrees with the reward model called directly.
    rm = reward_proxy.load(tiny_models["reward"])
    items = [json.loads(line) for line in battles.read_text().splitlines()]
    comps = [json.loads(line) for line in (tmp_path / "out" / "completions-rm-r0.jsonl").read_text().splitlines()]
    from evals.types import Item
    direct = reward_proxy.rewards(rm, [Item.model_validate(items[0])], [comps[0]["text"]])[0]
    ref = reward_proxy.rewards(rm, [Item.model_validate(items[0])], [items[0]["battle"]["chosen"]])[0]
    assert first["rm"].outcomes[0].values["margin"] == pytest.approx(direct - ref, abs=1e-5)


def test_sampled_replicates_of_a_judge_suite_are_each_judged(tiny_models, item, tmp_path, monkeypatch):
    # With sampling each replicate regenerates, so each is judged anew: its own file and A/B key.
    (tmp_path / "localjudge2.py").write_text("def first(prompt, a, b):\n    return 'VERDICT: A'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    battles = _write_items(tmp_path / "battles.jsonl", _battle_items(item))
    incumbent = tmp_path / "incumbent.jsonl"
    incumbent.write_text("".join(json.dumps({"item_id": f"b{i}", "text": "x", "n_tokens": 1, "stopped": True,
                                             "truncated": False, "empty": False, "has_replacement_char": False})
                                 + "\n" for i in range(4)))
    cfg = EvalJobConfig(checkpoint=tiny_models["llama"], decoding=Decoding(max_new_tokens=4, temperature=1.0),
                        replicates=2, seed=7, output_dir=tmp_path / "out",
                        judge={"kind": "callable", "target": "localjudge2:first"},
                        suites=[SuiteSpec(name="j", scorer="judge", items_path=battles, incumbent_completions=incumbent)])
    result = run(cfg)
    records = [r.judge for r in result.suites]
    assert [r.seed for r in records] == [7, 8] and records[0].judgments_path != records[1].judgments_path
    assert all(Path(r.judgments_path).is_file() for r in records)
    # A judge that always says A shows pure position bias: every item is inconsistent, win_score 0.5.
    assert all(o.label == "inconsistent" and o.values["win_score"] == 0.5 for r in result.suites for o in r.outcomes)


def test_bad_items_file_names_the_line(tiny_models, item, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_items(item, 1)[0].model_dump_json() + "\n" + '{"id": "x", "messages": []}\n')
    cfg = EvalJobConfig(checkpoint=tiny_models["llama"], decoding=Decoding(max_new_tokens=4),
                        output_dir=tmp_path / "o", suites=[SuiteSpec(name="s", scorer="loops", items_path=bad)])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a valid eval item"):
        run(cfg)


def test_command_line_prints_the_result_file_and_its_sha256(tiny_models, item, tmp_path, capsys):
    from core.util import file_sha256
    from evals.job import main

    items = tmp_path / "items.jsonl"
    _write_items(items, _items(item, 2))
    cfg = EvalJobConfig(checkpoint=tiny_models["llama"], decoding=Decoding(max_new_tokens=4),
                        output_dir=tmp_path / "o", suites=[SuiteSpec(name="s", scorer="loops", items_path=items)])
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    assert main([str(tmp_path / "cfg.json")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"result": str(tmp_path / "o" / "result.json"), "sha256": file_sha256(tmp_path / "o" / "result.json")}


def test_sealed_suite_refuses_replicates(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="sealed suites are scored once"):
        EvalJobConfig(checkpoint=tiny_models["llama"], decoding=Decoding(), output_dir=tmp_path, replicates=3,
                      suites=[SuiteSpec(name="c", scorer="math", items_path=tmp_path / "c.jsonl", sealed=True)])


def test_eval_job_through_submitit(tiny_models, item, tmp_path):
    plain = _write_items(tmp_path / "plain.jsonl", _items(item, 2))
    cfg = EvalJobConfig(checkpoint=tiny_models["llama"], decoding=Decoding(max_new_tokens=4),
                        output_dir=tmp_path / "out", suites=[SuiteSpec(name="len", scorer="length_stop", items_path=plain)])
    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(timeout_min=5)
    job = executor.submit(run, cfg)
    result = job.result()
    assert isinstance(result, EvalResult) and result.suites[0].metrics["n_tokens"] == 4.0


def test_battle_margin_scorer_signs(item):
    items = _battle_items(item, 2)
    lps = [battle_margin.BattleLogprobs(item_id="b0", chosen=-3.0, rejected=-5.0),
           battle_margin.BattleLogprobs(item_id="b1", chosen=-9.0, rejected=-2.0)]
    outs = battle_margin.score(items, lps)
    assert [o.values["prefers_chosen"] for o in outs] == [1.0, 0.0]
    assert [o.values["margin"] for o in outs] == [2.0, -7.0]


def test_a_checkpoint_saved_without_the_kv_cache_still_decodes_with_it(tiny_models, item, tmp_path):
    # A checkpoint saved mid-training says use_cache = false; generate() would then re-run the whole prefix at
    # every token. The loader turns the cache on, and the answers equal those of the same weights saved with it.
    import shutil

    src = tiny_models["nemotron_h"]
    off = tmp_path / "no-cache"
    shutil.copytree(src, off)
    for name in ("config.json", "generation_config.json"):
        path = off / name
        if path.is_file():
            data = json.loads(path.read_text())
            data["use_cache"] = False
            path.write_text(json.dumps(data))
    loaded = load(off)
    assert loaded.model.config.use_cache is True and loaded.model.generation_config.use_cache is True
    dec = Decoding(max_new_tokens=6)
    items = _items(item, n=3)
    assert [c.text for c in generate(loaded, items, dec, seed=0)] == [c.text for c in generate(load(src), items, dec, seed=0)]


def test_a_later_job_adds_the_same_draws_as_one_job_of_every_replicate(tiny_models, item, tmp_path):
    # Replicates 1-2 drawn by a second job (first_replicate = 1) equal replicates 1-2 of one job of 3: the same
    # seeds, so a candidate's later draws pair with the incumbent calibration's replicates of the same index.
    items = _write_items(tmp_path / "items.jsonl", _items(item, 3))
    hot = Decoding(max_new_tokens=6, temperature=1.0)
    spec = [SuiteSpec(name="s", scorer="loops", items_path=items)]
    whole = run(EvalJobConfig(checkpoint=tiny_models["llama"], decoding=hot, replicates=3, output_dir=tmp_path / "a",
                              suites=spec))
    later = run(EvalJobConfig(checkpoint=tiny_models["llama"], decoding=hot, replicates=2, first_replicate=1,
                              output_dir=tmp_path / "b", suites=spec))
    assert [(r.replicate, r.seed) for r in later.suites] == [(1, 1), (2, 2)]
    texts = [[json.loads(x)["text"] for x in Path(r.completions_path).read_text().splitlines()] for r in whole.suites]
    assert [[json.loads(x)["text"] for x in Path(r.completions_path).read_text().splitlines()]
            for r in later.suites] == texts[1:]
    assert texts[1] != texts[2]  # the draws differ from each other: the comparison above can fail
    with pytest.raises(ValueError, match="greedy replicates"):
        EvalJobConfig(checkpoint=tiny_models["llama"], decoding=Decoding(), replicates=2, first_replicate=1,
                      output_dir=tmp_path / "c", suites=spec)
