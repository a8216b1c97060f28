"""The toy world's cost model: how many GPU-hours one measured device-second of a toy job stands for.

The agent budgets GPU-hours; the toy world runs on a CPU. The world's lab.toml sets
`[executor] simulated_gpuh_per_device_s` to `GPUH_PER_DEVICE_S`, and the local executor settles each
toy job as measured seconds x that factor (labelled simulated in the ledger, report and card).

The factor is chosen so that `--budget 60gpuh` buys a session of the seeds' shape on the demo world.
Measured with `python -m tools.world.measure --lab DIR --out DIR --costs` on one otherwise idle x86-64
core (one intra-op thread, as the world's jobs run):

    one SFT arm: full fine-tune of the demo parent, 150 steps of batch 8     TRAIN_ARM_S  = 23.6 s
    one eval job: synthetic (240 items), loops and stop (80 each), K = 3     EVAL_S       = 15.3 s
    plus the judged dev holdout (72 battles, both orders, K = 3): allowance  JUDGE_S      =  5.0 s
    one merge (soup or dose of two 3.7 MB checkpoints): estimate, not timed  MERGE_S      =  2.0 s

A session of the seeds' shape: 12 training arms, 12 candidate evals plus 2 incumbent calibrations
(each an eval job with K = 3), 4 merges and the nomination checks (the sealed confirmation and the
reload check, about 2 eval jobs):

    session_s = 12 * 23.6 + 14 * 20.3 + 4 * 2.0 + 2 * 20.3 = 616 s
    factor    = 60 GPU-hours * (1 - 0.05 reserve) / 616 s = 0.0925 GPU-hours per device-second

(one toy device-second stands for about 5.5 GPU-minutes; a toy SFT arm for about 2.2 GPU-hours, the order
of a seed's LoRA arm). A slower or busier machine measures more seconds for the same jobs and so buys
fewer of them: the budget is charged what was measured.
"""

from __future__ import annotations

TRAIN_ARM_S = 23.6
EVAL_S = 15.3
JUDGE_S = 5.0
MERGE_S = 2.0
SESSION_BUDGET_GPUH = 60.0
RESERVE_FRACTION = 0.05


def session_device_s() -> float:
    """Device-seconds of a session of the seeds' shape on the demo world."""
    eval_job = EVAL_S + JUDGE_S
    return 12 * TRAIN_ARM_S + 14 * eval_job + 4 * MERGE_S + 2 * eval_job


GPUH_PER_DEVICE_S = round(SESSION_BUDGET_GPUH * (1 - RESERVE_FRACTION) / session_device_s(), 4)
