"""Evaluation: the batched generation engine at served decoding, one scorer per file, paired
statistics, the noise floor and pre-registered promotion bars.

- `types`: Item / Completion / Outcome records; a scorer is `(items, completions) -> list[Outcome]`.
- `generate`: load a checkpoint once, batched left-padded generation at a `decoding.Decoding`.
- scorers: `math`, `mcq`, `constraints` (rules in `constraint_rules`, IFEval reference semantics in
  `ifeval`), `loops`, `length_stop`,
  `synthetic`, `battle_margin`, `reward_proxy`, `judge`.
- `job`: the eval job `run(EvalJobConfig) -> EvalResult` (in-process, subprocess or Slurm).
- `stats`: exact McNemar, paired t, Wilcoxon, paired bootstrap, Holm.
- `records`: EvalResult <-> notebook eval rows; `noise`: noise floor from K replicates;
  `bars`: the bars file and its registration; `compare`: bars verdicts and refusals;
  `sealed`: once-per-session confirmation suites for the nominee.
"""


def __getattr__(name: str):
    # `evals.run(EvalJobConfig)` is the eval job (DESIGN.md); imported on first use so that light
    # imports such as `evals.decoding` do not pull in torch and transformers.
    if name == "run":
        from evals.job import run

        return run
    raise AttributeError(f"module 'evals' has no attribute {name!r}")
