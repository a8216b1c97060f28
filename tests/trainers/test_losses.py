"""Chunked head + losses at supervised positions equal the plain full-logits computation, values and gradients.

Tolerance: both sides compute the same float32 dot products for each logit (a [chunk, d] x [d, V] block instead of
[B*T, d] x [d, V]) and the same log_softmax per position; BLAS may block the two shapes differently, so a logit may
differ by a few ulps of its magnitude (|z| < 10 here): atol 1e-5 on log-probs of magnitude ~7, and on gradients.
A real difference (a shifted position, a wrong target, a missing row) moves values by ~1.
"""

import pytest
import torch
from trainer_testkit import MEMO, assistant, user
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers import losses
from trainers.batch import encode, logits, pad_batch, token_logprobs
from trainers.common import LoRASettings, load_policy
from trainers.klce import forward_kl

ATOL = 1e-5


def _batch(tok):
    rows = [encode(tok, [user(q), assistant(a)], "Be brief.", 256) for q, a in MEMO[:3]]
    rows.append(encode(tok, [user("Hi"), assistant("Hello there, how are you today?")], None, 256))
    return pad_batch(rows, tok.pad_token_id)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(("kind", "lora"), [("llama", None), ("nemotron_h", LoRASettings(r=4, alpha=8, train_lm_head=True))])
def test_chunked_logprobs_equal_plain_values_and_gradients(kind, lora, model_dirs):
    tok = AutoTokenizer.from_pretrained(model_dirs[kind])
    model = load_policy(model_dirs[kind], "float32", lora, seed=0)
    batch = _batch(tok)
    plain = token_logprobs(logits(model, batch), batch.input_ids)[batch.loss_mask > 0]
    plain.sum().backward()
    expected = _grads(model)
    got, pos = losses.token_logprobs(model, batch, chunk=5)  # several chunks, the last one short
    got.sum().backward()
    assert got.shape == plain.shape and pos.rows.tolist() == sorted(pos.rows.tolist())
    torch.testing.assert_close(got, plain.detach(), rtol=0, atol=ATOL)
    grads = _grads(model)
    assert grads.keys() == expected.keys() and grads
    for k in grads:
        torch.testing.assert_close(grads[k], expected[k], rtol=0, atol=ATOL)
    per_row = losses.sequence_logprobs(model, batch, chunk=7)
    manual = (token_logprobs(logits(model, batch), batch.input_ids) * batch.loss_mask).sum(-1)
    torch.testing.assert_close(per_row, manual, rtol=0, atol=4 * ATOL)


def test_chunked_ce_and_kl_equal_plain_with_separate_and_own_base_parent(model_dirs):
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    batch = _batch(tok)
    parent = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).eval().requires_grad_(False)
    policy = load_policy(model_dirs["llama"], "float32", None, seed=0)
    select = batch.loss_mask > 0
    pl = logits(policy, batch)
    with torch.no_grad():
        par = logits(parent, batch)
    ce_plain = -token_logprobs(pl, batch.input_ids)[select]
    kl_plain = forward_kl(par, pl)[select]
    (ce_plain.sum() + 0.5 * kl_plain.sum()).backward()
    expected = _grads(policy)
    with torch.no_grad():
        hidden = losses.supervised_hidden(parent, batch)
    ce, kl, _ = losses.ce_and_kl(policy, batch, hidden, losses.frozen_head(parent.get_output_embeddings()), chunk=6)
    (ce.sum() + 0.5 * kl.sum()).backward()
    torch.testing.assert_close(ce, ce_plain.detach(), rtol=0, atol=ATOL)
    torch.testing.assert_close(kl, kl_plain.detach(), rtol=0, atol=ATOL)
    assert float(kl.min()) > 0
    for k, g in _grads(policy).items():
        torch.testing.assert_close(g, expected[k], rtol=0, atol=ATOL)


def test_own_base_parent_is_the_policy_with_adapter_and_head_copy_off(model_dirs):
    tok = AutoTokenizer.from_pretrained(model_dirs["nemotron_h"])
    batch = _batch(tok)
    policy = load_policy(model_dirs["nemotron_h"], "float32", LoRASettings(r=4, alpha=8, train_lm_head=True), 0)
    with torch.no_grad():  # move the adapter and head copy away from the base
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    base = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"]).eval()
    with torch.no_grad():
        par = logits(base, batch)
        with policy.disable_adapter():
            hidden = losses.supervised_hidden(policy, batch)
        _, kl, _ = losses.ce_and_kl(policy, batch, hidden, policy.get_output_embeddings().original_module, chunk=4)
        expected = forward_kl(par, logits(policy, batch))[batch.loss_mask > 0]
    assert float(kl.max()) > 1e-4
    torch.testing.assert_close(kl, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "nemotron_h"])
def test_activation_checkpointing_changes_memory_not_gradients(kind, model_dirs):
    from trainers.sft import SFTObjective

    tok = AutoTokenizer.from_pretrained(model_dirs[kind])
    encoded = [encode(tok, [user(q), assistant(a)], None, 256) for q, a in MEMO[:3]]
    objective = SFTObjective(encoded, tok.pad_token_id, None, chunk=8)
    out = []
    for checkpointing in (False, True):
        model = load_policy(model_dirs[kind], "float32", None, seed=0, activation_checkpointing=checkpointing)
        assert model.is_gradient_checkpointing == checkpointing
        part = objective.loss(model, [0, 1, 2], objective.normalizer([0, 1, 2]))
        part.loss.backward()
        out.append((part.loss.detach(), _grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = out
    # Recomputation runs the same kernels on the same inputs: equal to the last bit in practice, ATOL in principle.
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=ATOL)
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=0, atol=ATOL)
