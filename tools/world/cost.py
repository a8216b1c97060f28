"""The toy world's cost model: how many GPU-hours one measured device-second of a toy job stands for.

The agent budgets GPU-hours; the toy world runs on a CPU. The world's lab.toml sets
`[executor] simulated_gpuh_per_device_s` to `GPUH_PER_DEVICE_S`, and the local executor settles each
toy job as measured seconds x that factor (labelled simulated in the ledger, report and card).

The factor is chosen so that `--budget 60gpuh` buys a session of the seeds' shape on the demo world.
Measured on the 2-core build machine (tools/world/README figures, `python -m tools.world.measure`):

    one SFT arm (full fine-tune, 150 steps, batch 8)     ~ TRAIN_ARM_S device-seconds
    one eval job (synthetic + loops + stop suites, K=3, plus the judged holdout)
                                                         ~ EVAL_JOB_S device-seconds
    the seeds' shape: 12 arms, 12 candidate evals + 2 incumbent calibrations (K=3 each),
    4 merges (~MERGE_S each) and the nomination checks (sealed confirmation + reload, ~ 2 eval jobs)

    session_s = 12 * TRAIN_ARM_S + 14 * EVAL_JOB_S + 4 * MERGE_S + 2 * EVAL_JOB_S
    factor    = 60 GPU-hours * (1 - reserve 0.05) / session_s

so such a session spends the budget down to its reserve, and a planner that wastes jobs runs out.
"""

from __future__ import annotations

TRAIN_ARM_S = 40.0
EVAL_JOB_S = 25.0
MERGE_S = 5.0
SESSION_BUDGET_GPUH = 60.0
RESERVE_FRACTION = 0.05


def session_device_s() -> float:
    """Device-seconds of a session of the seeds' shape on the demo world."""
    return 12 * TRAIN_ARM_S + 14 * EVAL_JOB_S + 4 * MERGE_S + 2 * EVAL_JOB_S


GPUH_PER_DEVICE_S = round(SESSION_BUDGET_GPUH * (1 - RESERVE_FRACTION) / session_device_s(), 4)
