"""Every action the agent can take, as typed tools: data builders, the job launcher and the
GPU-hour ledger, training/merge/eval submission, calibration, bars, comparison and nomination.
"""
