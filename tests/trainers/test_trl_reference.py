"""TRL 1.16 as the reference for our losses: same inputs, TRL's own trainers' `compute_loss`, same numbers.

The trainers keep an in-house loop (reasons in trainers/loop.py, sft.py, dpo.py); these tests pin their
loss formulas to TRL's: SFTTrainer with `assistant_only_loss=True`, and DPOTrainer with
`loss_type=["sigmoid", "sft"]`, `loss_weights=[1, nll_weight]` and an explicit `ref_model`.
"""

import math

import pytest
import torch
from trainer_testkit import assistant, user
from transformers import AutoModelForCausalLM, AutoTokenizer

from core import chat
from trainers.batch import Encoded, encode, pad_batch, sequence_logprobs
from trainers.dpo import DPOObjective, pair_logprobs
from trainers.sft import SFTObjective

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

BETA, NLL_WEIGHT = 0.5, 0.2
EPS32 = torch.finfo(torch.float32).eps


def logprob_scale(model, seqs: list[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum over its supervised tokens of |z_y| + |logsumexp z| (the magnitudes at which each token
    log-prob z_y - logsumexp z is rounded, before any cancellation), and the number of those tokens."""
    batch = pad_batch(seqs, pad_id)
    with torch.no_grad():
        z = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
    z_y = z.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return ((z_y.abs() + z.logsumexp(-1).abs()) * batch.loss_mask).sum(-1), batch.loss_mask.sum(-1)


def float32_tolerance(magnitude: float, n_terms: float) -> float:
    """How far two float32 computations of one loss (ours and TRL's: other kernels, other summation orders) may
    differ. Each rounds n_terms token log-probs whose weighted magnitudes add up to `magnitude` (M = sum |w_t| *
    (|z_y| + |lse|)); independent roundings add in quadrature, so each result lies within sqrt(n) * eps * M of the
    exact value with high probability (probabilistic rounding-error analysis: Higham & Mary 2019, "A New Approach
    to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5)); the two may differ by twice that.
    The float32 forward pass itself measured 0.04 eps * M against float64 on these tiny models (test below)."""
    return 2 * math.sqrt(n_terms) * EPS32 * magnitude


def dpo_tolerance(policy, ref, pairs: list[tuple[Encoded, Encoded]], pad_id: int) -> float:
    """float32_tolerance of the DPO + NLL loss: beta weighs the 4 summed log-probs of each pair's margin,
    nll_weight / n_c the chosen answer's, all divided by the number of pairs."""
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    (pol, n), (ref_scale, _) = logprob_scale(policy, seqs, pad_id), logprob_scale(ref, seqs, pad_id)
    k = len(pairs)
    magnitude = BETA * (pol.sum() + ref_scale.sum()) + NLL_WEIGHT * (pol[:k] / n[:k]).sum()
    return float32_tolerance(float(magnitude) / k, 2 * float(n.sum()))

# Our ChatML template with transformers' `{% generation %}` markers around what our renderer supervises
# (assistant content + <|im_end|>): how SFTTrainer learns which tokens are the assistant's.
MARKED_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, user("What is 1 + 1?"), assistant("The answer is 2.")],
    [user("Count: a b c"), assistant("3"), user("And x y?"), assistant("It is 2, I think.")],
    [user("What is 12 + 30?"), assistant("42")],
]


def _trl_args(cls, tmp_path, **kw):
    # TRL 1.16 defaults to bf16=True: DPOTrainer then has accelerate prepare its ref_model with bf16 autocast (the
    # policy is only prepared by train()), which moved the reference log-probs by up to 2e-3 and the loss by 8e-5 from
    # our FP32 ones. Our runs compute in the model's dtype (FP32 here), so TRL runs FP32 too.
    return cls(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, per_device_train_batch_size=2, bf16=False, **kw)


def test_sft_assistant_only_loss_equals_trl_sft_trainer(model_dirs, tmp_path):
    plain = AutoTokenizer.from_pretrained(model_dirs["llama"])  # ChatML, masked by our renderer's prefix differences
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    tok.chat_template = MARKED_TEMPLATE
    for conversation in CONVERSATIONS:  # the marked template is our renderer, byte for byte
        assert tok.apply_chat_template(conversation, tokenize=False) == chat.render_text(plain, conversation)
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    trainer = trl.SFTTrainer(
        model=model, args=_trl_args(trl.SFTConfig, tmp_path, assistant_only_loss=True), processing_class=tok,
        train_dataset=datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS]),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(CONVERSATIONS))])
    encoded = [encode(plain, c, None, 256) for c in CONVERSATIONS]
    for i, e in enumerate(encoded):  # same ids, and TRL's assistant mask is our loss mask
        n = len(e.input_ids)
        assert batch["input_ids"][i, :n].tolist() == e.input_ids
        assert (batch["labels"][i, :n] != -100).int().tolist() == e.loss_mask
    ours = SFTObjective(encoded, tok.pad_token_id, None)
    rows = list(range(len(CONVERSATIONS)))
    with torch.no_grad():
        expected = trainer.compute_loss(model, dict(batch))
        got = ours.loss(model, rows, ours.normalizer(rows)).loss
    # Both are token-level means over all supervised tokens of the batch (TRL divides by the batch's
    # label count, or num_items_in_batch across accumulation steps: our per-step normalizer).
    scale, n = logprob_scale(model, encoded, tok.pad_token_id)
    tol = float32_tolerance(float(scale.sum() / n.sum()), float(n.sum()))
    torch.testing.assert_close(got, expected, rtol=0, atol=tol)


def _pairs(tok, rows) -> list[tuple[Encoded, Encoded]]:
    def one(q, a):
        return encode(tok, [user(q), assistant(a)], None, 256)

    return [(one(q, c), one(q, r)) for q, c, r in rows]


def _trl_dpo_loss(policy, ref, tok, pairs, rows, loss_weights, tmp_path) -> torch.Tensor:
    """DPOTrainer.compute_loss on our token ids, with our assistant mask as its completion mask."""
    data = datasets.Dataset.from_list([{"prompt": [user(q)], "chosen": [assistant(c)], "rejected": [assistant(r)]}
                                       for q, c, r in rows])
    args = _trl_args(trl.DPOConfig, tmp_path, beta=BETA, loss_type=["sigmoid", "sft"], loss_weights=loss_weights)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]  # TRL's batch layout: all chosen, then all rejected
    batch = pad_batch(seqs, tok.pad_token_id)
    completion_mask = torch.zeros_like(batch.input_ids)
    for i, e in enumerate(seqs):
        completion_mask[i, : len(e.loss_mask)] = torch.tensor(e.loss_mask)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "completion_mask": completion_mask}
    with torch.no_grad():
        return trainer.compute_loss(policy, inputs)


@pytest.fixture(scope="module")
def policy_and_ref(model_dirs):
    # Different weights (same vocabulary), so the DPO margins are far from zero.
    return (AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).eval(),
            AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval())


def _ours(policy, ref, tok, pairs):
    objective = DPOObjective(pairs, pair_logprobs(ref, pairs, tok.pad_token_id, 8), list(range(len(pairs))),
                             tok.pad_token_id, BETA, NLL_WEIGHT)
    rows = list(range(len(pairs)))
    with torch.no_grad():
        return objective.loss(policy, rows, objective.normalizer(rows))


def test_dpo_nll_loss_equals_trl_dpo_trainer_on_equal_length_answers(policy_and_ref, model_dirs, tmp_path):
    policy, ref = policy_and_ref
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    rows = [("What is 1 + 1?", "The answer is 2.", "No."), ("What is 3 + 4?", "The answer is 7.", "Eight, surely.")]
    pairs = _pairs(tok, rows)
    assert pairs[0][0].supervised == pairs[1][0].supervised  # the conventions below agree only then
    ours = _ours(policy, ref, tok, pairs)
    tol = dpo_tolerance(policy, ref, pairs, tok.pad_token_id)
    torch.testing.assert_close(
        ours.loss, _trl_dpo_loss(policy, ref, tok, pairs, rows, [1.0, NLL_WEIGHT], tmp_path), rtol=0, atol=tol)
    # The sigmoid DPO term alone (loss_weights [1, 0]) is our `dpo` metric, the mean over pairs.
    dpo_only = _trl_dpo_loss(policy, ref, tok, pairs, rows, [1.0, 0.0], tmp_path / "dpo")
    assert float(dpo_only) == pytest.approx(ours.metrics["dpo"], rel=0, abs=tol)
    # With policy == reference every margin is 0 and the DPO term is log 2: here they really differ.
    assert abs(ours.metrics["dpo"] - math.log(2)) > 1e-2


UNEQUAL_ROWS = [("What is 1 + 1?", "2", "No."), ("What is 12 + 30?", "It is 42, I think, because 12 + 30 = 42.", "41")]


def check_nll_averaging(policy, ref, tok, tmp_path) -> float:
    """Chosen answers of different lengths: TRL's "sft" term is the mean NLL over all chosen tokens of the
    batch, sum_i(-log pi_c_i) / sum_i n_c_i; ours is the mean over pairs of each answer's per-token NLL,
    mean_i(-log pi_c_i / n_c_i) (Pang et al. 2024, eq. 3: every pair weighs the same whatever its length).
    The sigmoid DPO terms are identical; nothing else differs. Returns the tolerance it used."""
    pairs = _pairs(tok, UNEQUAL_ROWS)
    ours = _ours(policy, ref, tok, pairs)
    n_c = torch.tensor([float(c.supervised) for c, _ in pairs])
    with torch.no_grad():
        nll_sum = -sequence_logprobs(policy, pad_batch([c for c, _ in pairs], tok.pad_token_id))
    trl_loss = _trl_dpo_loss(policy, ref, tok, pairs, UNEQUAL_ROWS, [1.0, NLL_WEIGHT], tmp_path)
    tol = dpo_tolerance(policy, ref, pairs, tok.pad_token_id)
    torch.testing.assert_close(trl_loss, torch.tensor(ours.metrics["dpo"] + NLL_WEIGHT * float(nll_sum.sum() / n_c.sum())),
                               rtol=0, atol=tol)
    torch.testing.assert_close(ours.loss, torch.tensor(ours.metrics["dpo"] + NLL_WEIGHT * float((nll_sum / n_c).mean())),
                               rtol=0, atol=tol)
    assert abs(float(ours.loss) - float(trl_loss)) > 10 * tol  # the two conventions really differ here
    return tol


def test_dpo_nll_term_differs_from_trl_only_by_its_averaging(policy_and_ref, model_dirs, tmp_path):
    check_nll_averaging(*policy_and_ref, AutoTokenizer.from_pretrained(model_dirs["llama"]), tmp_path)


def test_tolerance_still_catches_a_changed_nll_averaging(policy_and_ref, model_dirs, tmp_path, monkeypatch):
    """The tolerance is loose enough for float32 on any CPU and tight enough for a formula change: with our NLL
    term switched to TRL's token-level averaging (a real formula difference), the check above fails."""
    from trainers import dpo

    def trl_averaging(pi_c, n_c):
        return (-pi_c.sum() / n_c.sum()).expand_as(pi_c)  # every pair gets the batch's token-level mean

    monkeypatch.setattr(dpo, "chosen_nll", trl_averaging)
    with pytest.raises(AssertionError, match="not close"):
        check_nll_averaging(*policy_and_ref, AutoTokenizer.from_pretrained(model_dirs["llama"]), tmp_path)


def test_tolerance_covers_the_float32_forward_pass(policy_and_ref, model_dirs):
    """Where the tolerance comes from, measured: the DPO + NLL loss of float32 models and arithmetic lies well
    within half the tolerance (one side's share) of the same loss computed in float64 throughout."""
    policy, ref = policy_and_ref
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    pairs = _pairs(tok, UNEQUAL_ROWS)
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    batch = pad_batch(seqs, tok.pad_token_id)

    def exact_logps(model):
        with torch.no_grad():
            z = model.double()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            model.float()
        return (z.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0] * batch.loss_mask.double()).sum(-1)

    tol = dpo_tolerance(policy, ref, pairs, tok.pad_token_id)
    pi, pr = exact_logps(policy), exact_logps(ref)
    k = len(pairs)
    margin = BETA * ((pi[:k] - pr[:k]) - (pi[k:] - pr[k:]))
    n_c = torch.tensor([float(c.supervised) for c, _ in pairs], dtype=torch.float64)
    exact = float((-torch.nn.functional.logsigmoid(margin) + NLL_WEIGHT * (-pi[:k] / n_c)).mean())
    assert abs(float(_ours(policy, ref, tok, pairs).loss) - exact) < tol / 2


def test_trl_conversational_dpo_also_supervises_the_newline_after_end_of_turn(model_dirs, tmp_path):
    """Why the DPO tests above feed TRL our mask: TRL's conversational tokenization takes the completion as
    everything after the prompt, which includes the template's "\\n" after <|im_end|>; our renderer (the
    issue's rule) supervises the assistant content and <|im_end|> only."""
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    rows = [("What is 1 + 1?", "The answer is 2.", "No.")]
    data = datasets.Dataset.from_list([{"prompt": [user(q)], "chosen": [assistant(c)], "rejected": [assistant(r)]}
                                       for q, c, r in rows])
    policy, ref = (AutoModelForCausalLM.from_pretrained(model_dirs["llama"]) for _ in range(2))
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=_trl_args(trl.DPOConfig, tmp_path),
                             train_dataset=data, processing_class=tok)
    chosen = _pairs(tok, rows)[0][0]
    ours = [t for t, m in zip(chosen.input_ids, chosen.loss_mask, strict=True) if m]
    assert trainer.train_dataset[0]["chosen_ids"] == ours + tok("\n", add_special_tokens=False)["input_ids"]
    assert trainer.train_dataset[0]["prompt_ids"] + ours == chosen.input_ids[: len(chosen.input_ids) - 1]
