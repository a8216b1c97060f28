"""The engine's captured choice of the next token (evals.generate._Sampler, _draw) against the reference sampling."""

from __future__ import annotations

import math

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from evals.decoding import Decoding
from evals.generate import _draw, _Sampler, generation_config


def test_the_draw_is_multinomials_own_for_the_same_seed():
    """Same generator state in, same tokens and same state out as torch.multinomial(probs, 1), also with tokens of
    probability zero (a top-p cut)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(256, 50, generator=gen), -1)
    probs[:, 20:] = 0
    torch.manual_seed(11)
    expected, after = torch.multinomial(probs, 1).squeeze(1), torch.rand(4)
    torch.manual_seed(11)
    got = _draw(probs.clone())
    assert torch.equal(got, expected) and torch.equal(torch.rand(4), after)
    assert int(got.max()) < 20


def test_the_penalty_over_the_static_buffer_is_the_penalty_over_the_prefix():
    """Positions not generated yet hold the row's last prompt token: the penalised set, and so the scores, are those
    of transformers' processor over the prompt and the tokens generated so far."""
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 40, (6, 9), generator=gen)
    static = torch.cat([prefix, prefix[:, -1:].expand(6, 7)], 1)
    scores = torch.randn(6, 40, generator=gen)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    assert torch.equal(penalty(static, scores.clone()), penalty(prefix, scores.clone()))
    config = generation_config(Decoding(temperature=0.8, top_p=0.9, repetition_penalty=1.3), [0], 1)
    assert torch.equal(_Sampler(config, [0]).procs(static, scores.clone()),
                       _Sampler(config, [0]).procs(prefix, scores.clone()))


def _served_distribution(logits: torch.Tensor, seen: set[int], penalty: float, temperature: float,
                         top_p: float) -> torch.Tensor:
    """The served decoding's next-token distribution written out by hand (CTRL's penalty, Keskar et al. 2019;
    nucleus sampling, Holtzman et al. 2020): the smallest set of most likely tokens whose mass reaches top_p."""
    z = logits.clone()
    for t in seen:
        z[t] = z[t] * penalty if z[t] < 0 else z[t] / penalty
    p = torch.softmax(z / temperature, -1).double()
    order = torch.argsort(p, descending=True)
    mass, kept = 0.0, []
    for t in order.tolist():
        kept.append(t)
        mass += float(p[t])
        if mass >= top_p:
            break
    q = torch.zeros_like(p)
    q[kept] = p[kept]
    return q / q.sum()


def test_sampled_tokens_follow_the_served_distribution():
    """20,000 draws over a 12-token vocabulary (fixed seed) from the sampler as the engine calls it, with the two
    most likely tokens but one and the least likely already seen: no token outside the nucleus, and the counts
    within it pass a chi-square test at the 0.1% level against the hand-written served distribution (a sampler
    without the penalty, the temperature or the cut fails it: chi-square 3160, 47 and 144 against a limit of 23)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(12, generator=gen) * 1.5
    order = torch.argsort(logits, descending=True).tolist()
    seen = [order[0], order[0], order[2], order[-1]]
    config = generation_config(Decoding(temperature=0.9, top_p=0.9, repetition_penalty=1.5), [0], 1)
    rows = 20_000
    torch.manual_seed(3)
    tokens = _Sampler(config, [0])(torch.tensor(seen).expand(rows, 4), logits.expand(rows, 12).clone())
    counts = torch.bincount(tokens, minlength=12).double()
    expected = _served_distribution(logits, set(seen), 1.5, 0.9, 0.9) * rows
    assert float(counts[expected == 0].sum()) == 0
    inside = expected > 0
    chi2 = float(((counts[inside] - expected[inside]) ** 2 / expected[inside]).sum())
    dof = int(inside.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - 0.001 for `dof` degrees of freedom.
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert dof >= 4 and chi2 < limit, (chi2, limit, counts.tolist(), expected.tolist())
