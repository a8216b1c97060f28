"""The job engine: the launcher (submitit, idempotency keys, budget admission, settlement), the warm zygote,
executor settings, the worker-side job runner, the failure policy and live progress.
"""
