"""Rejection-sampling FT with the synthetic eval checker as the verifier."""

import json

import pytest
from pydantic import ValidationError
from trainer_testkit import assert_trained, metric_series, reload_and_generate, write_jsonl

from evals.synthetic import check, generate
from evals.types import Completion, completion_from_text
from trainers.rft import RFTConfig, select, train
from trainers.rows import SFTRow, read_rows
from trainers.sft import SFTConfig
from trainers.sft import train as sft_train


@pytest.fixture(scope="module")
def digit_sum(tmp_path_factory):
    """Four digit-sum items, and SFT rows of their reference answers."""
    root = tmp_path_factory.mktemp("rft")
    tasks = generate("digit_sum", 4, 7)
    items = root / "items.jsonl"
    items.write_text("".join(t.item.model_dump_json() + "\n" for t in tasks))
    refs = write_jsonl(root / "refs.jsonl", [
        {"messages": [m.model_dump() for m in t.item.messages] + [{"role": "assistant", "content": t.reference}]}
        for t in tasks])
    return items, refs, {t.item.id: t.item for t in tasks}


@pytest.mark.parametrize("kind", ["llama", "nemotron_h"])
def test_rft_samples_verifies_keeps_and_trains(kind, model_dirs, digit_sum, tmp_path):
    items, refs, by_id = digit_sum
    # A policy that sometimes gets these right: a short SFT on the reference answers.
    policy = sft_train(SFTConfig(model_path=model_dirs[kind], data_path=refs, output_dir=tmp_path / "pre",
                                 lr=1e-2, steps=40, batch_size=4, micro_batch_size=4)).model_dir
    config = RFTConfig(model_path=policy, data_path=items, output_dir=tmp_path / "rft", lr=1e-2, steps=8,
                       batch_size=2, micro_batch_size=2, k=4, temperature=1.0, max_new_tokens=40)
    result = train(config)
    samples = [json.loads(x) for x in (tmp_path / "rft" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    verified = {}
    for s in samples:
        # The recorded verdict is the eval checker's verdict (and the answer stopped cleanly).
        assert s["verified"] == (check(by_id[s["item_id"]], s["text"]) and s["stopped"])
        verified.setdefault(s["item_id"], []).append(s["verified"])
    st = result.sampling
    assert st.pass_at_1 == pytest.approx(sum(v.count(True) for v in verified.values()) / 16)
    assert st.pass_at_k == pytest.approx(sum(any(v) for v in verified.values()) / 4)
    assert 0 < st.pass_at_1 <= st.pass_at_k and st.kept == round(st.pass_at_k * 4)
    for row in read_rows(st.sft_data_path, SFTRow):
        assert check(by_id[row.id], row.messages[-1].content)
    assert result.train.steps == 8 and result.train.data_sha256
    losses = metric_series(tmp_path / "rft" / "sft")
    assert losses[-1] < losses[0]
    assert_trained(result.train)
    reload_and_generate(result.train)
    # A requeue of the finished job returns the stored result and resamples nothing.
    mtime = (tmp_path / "rft" / "samples.jsonl").stat().st_mtime_ns
    assert train(config) == result
    assert (tmp_path / "rft" / "samples.jsonl").stat().st_mtime_ns == mtime


def _c(n: int) -> Completion:
    return completion_from_text("i", "x" * n, n, stopped=True)


def test_selection_rules():
    samples = [(_c(9), True), (_c(3), False), (_c(5), True), (_c(7), True), (_c(1), True)]
    assert select(samples, "median_length").n_tokens == 5  # lower median of 1, 5, 7, 9
    assert select(samples, "shortest").n_tokens == 1
    assert select([(_c(2), False)], "median_length") is None


def test_bad_scorer_is_refused(model_dirs, digit_sum, tmp_path):
    items, _, _ = digit_sum
    with pytest.raises(ValidationError, match="scorer: cannot import 'evals.nope:score'"):
        RFTConfig(model_path=model_dirs["llama"], data_path=items, output_dir=tmp_path / "r", scorer="evals.nope:score")
    with pytest.raises(ValidationError, match="is not 'module:function'"):
        RFTConfig(model_path=model_dirs["llama"], data_path=items, output_dir=tmp_path / "r", scorer="evals.synthetic")


def test_a_constraints_pool_verifies_answers_that_follow_every_constraint():
    """RFT's verifier is the eval scorer: the constraints scorer says `strict`, not `correct` (a lab's own verified pool
    of constraint items trained nothing while only `correct` was read)."""
    from pydantic import TypeAdapter

    from evals import constraints
    from evals.constraint_rules import Constraint
    from evals.types import Item, Message
    from trainers.rft import _verified

    rule = TypeAdapter(Constraint).validate_python({"kind": "postscript"})
    item = Item(id="c1", messages=[Message(role="user", content="Write a note with a P.S.")], constraints=(rule,))
    good = completion_from_text("c1", "Body.\nP.S. see you", 6, stopped=True)
    bad = completion_from_text("c1", "Body only.", 3, stopped=True)
    unstopped = completion_from_text("c1", "Body.\nP.S. see you", 6, stopped=False)
    outcomes = constraints.score([item] * 3, [good, bad, unstopped])
    assert [_verified(o, c) for o, c in zip(outcomes, [good, bad, unstopped], strict=True)] == [True, False, False]
