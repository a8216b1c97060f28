"""Job entry points that run on a worker (locally or on a Slurm node): SFT, DPO+NLL, KL-leashed CE,
rejection-sampling FT and merges, plus the one chat renderer, collation and checkpoint/resume.

Each job is a plain function taking one pydantic config and returning a pydantic result.
"""
