"""The toy world's cost model: how many GPU-hours one measured device-second of a toy job stands for.

The agent budgets GPU-hours; the toy world runs on a CPU. The world's lab.toml sets
`[executor] simulated_gpuh_per_device_s` to `GPUH_PER_DEVICE_S` and `[budget] reserve_fraction` to
`RESERVE_FRACTION`, and the local executor settles each toy job as measured seconds x that factor
(labelled simulated in the ledger, report and card). Every job counts, the data jobs (ingest, dataset
builds) and the nomination's bundle job included: each is a process that pays the start of the job stack.

The factor is chosen so that `--budget 60gpuh` buys the session the agent really runs on the demo world
(the playbook's full protocol, below) twice over: a machine twice as slow or as busy as the one measured
still finishes it, and a quiet one spends about half. The reserve is sized the same way for the
nomination's jobs, which run on it alone.

Seconds of one job on the demo world, one intra-op thread (as the world's jobs run), in CPU seconds of the
process (the wall time of a quiet core; on the shared machine the wall clock ran 5-10 times longer):

    job start: python, torch, transformers, the job module, the model     START_S    = 12.0
        (`/usr/bin/time python -c "import trainers.sft, evals.job, evals.generate, submitit, transformers"`:
        10.7 s user + 0.9 s sys; the model of ~1M parameters loads in well under a second)
    one SFT step, batch 8 (tools/world/measure.py; 20 steps: 6.3 s CPU)     STEP_S     = 0.3
    generating 64 answers to the served cap of 64 tokens (one batch)        BATCH_S    = 3.3
        (evals.generate on a demo-size model: 3.3 s CPU; 256 answers in 10.3 s)
    a data job (ingest and split, or a leak-audited dataset build)          DATA_S     = 5.0
        (imports of tools.data.datasets and tools.data.splits: 1.4 s CPU; the rest is the audit, an estimate)

From those, per job (demo suites: synthetic 72, loops 32, stop 32, dev holdout 143 battles of the 0.3 dev split):

    eval job, K = 1: 279 answers = 4.36 batches                             12 + 14.4 = 26.4 s
    calibration: reference answers (143) + eval job K = 3                    (12 + 7.4) + (12 + 43.2) = 74.6 s
    SFT/DPO/KL-CE arm of 30 steps (the playbook's)                           12 + 9 = 21 s (RFT: + 288 samples)
    merge (soup or dose of two ~4 MB checkpoints)                            12 + 1 = 13 s
    bundle (shards, templates, reload and 5 answers)                        12 + 4 = 16 s
    sealed confirmation: reference answers (48) + eval job K = 1 (48)        (12 + 2.5) + (12 + 2.5) = 29 s

The playbook's full protocol (agent/planners/playbook.py) as counted below: ingest and 4 dataset builds;
6 training arms (4 families, 2 sweep settings; RFT's samples counted as 4.5 batches); 3 merges (a soup
and 2 doses); 11 K = 1 evals (6 arms, 3 merges, 2 serving alternatives); 3 calibrations (the parent and 2
promotions); then the nomination: 1 bundle and the sealed confirmation.

    main loop   25 + 6 * 21 + 15 + 3 * 13 + 11 * 26.4 + 3 * 74.6 = 719 s
    nomination  16 + 29 = 45 s
    reserve     RESERVE_FRACTION * 60 = 9 GPU-h, 5.6 x the nomination's 45 s at the factor below
    factor      60 GPU-h * (1 - 0.15) / (2 * 719 s) = 0.0355 GPU-hours per device-second

(one toy device-second stands for about 2.1 GPU-minutes; a toy SFT arm for about 0.75 GPU-hours). A slower
or busier machine measures more seconds for the same jobs and so buys fewer of them: the budget is charged
what was measured, and admission (tools/jobs/launcher.py) still never lets a session pass it.
"""

from __future__ import annotations

START_S = 12.0
STEP_S = 0.3
BATCH_S = 3.3
DATA_S = 5.0
ARM_STEPS = 30
EVAL_ANSWERS = 72 + 32 + 32 + 143
REFERENCE_ANSWERS = 143
SEALED_ANSWERS = 48
RFT_EXTRA_S = 4.5 * BATCH_S
SESSION_BUDGET_GPUH = 60.0
RESERVE_FRACTION = 0.15
SLACK = 2.0


def eval_s(replicates: int, answers: int = EVAL_ANSWERS) -> float:
    """One eval job: its start, then `answers` generated `replicates` times."""
    return START_S + replicates * answers / 64 * BATCH_S


def calibration_s() -> float:
    """The incumbent's calibration: the reference-answer job, then the K = 3 eval job."""
    return eval_s(1, REFERENCE_ANSWERS) + eval_s(3)


def session_device_s() -> float:
    """Device-seconds of the main loop of the playbook's full protocol on the demo world."""
    arm = START_S + ARM_STEPS * STEP_S
    merge = START_S + 1.0
    return 5 * DATA_S + 6 * arm + RFT_EXTRA_S + 3 * merge + 11 * eval_s(1) + 3 * calibration_s()


def nomination_device_s() -> float:
    """Device-seconds of the nomination's jobs: the bundle, and the sealed confirmation."""
    return (START_S + 4.0) + eval_s(1, SEALED_ANSWERS) + eval_s(1, SEALED_ANSWERS)


GPUH_PER_DEVICE_S = round(SESSION_BUDGET_GPUH * (1 - RESERVE_FRACTION) / (SLACK * session_device_s()), 4)
