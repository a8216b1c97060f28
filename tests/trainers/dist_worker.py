"""One rank of a distributed test job, started by torchrun: runs the trainer jobs listed in a JSON file in order.

    .venv/bin/torchrun --standalone --nproc-per-node 2 tests/trainers/dist_worker.py JOBS.json

JOBS.json: {"jobs": [{"trainer": "sft" | "dpo" | "klce" | "rft", "config": {...}}], "hold": null | {"step": N, "until":
PATH}}. With `hold`, rank 1 writes its pid to PATH.pid, and at its N-th optimizer step of the last job touches
PATH.held and waits until PATH exists (or, with "exit_after_s", exits after that long: a hung rank) (the test sends that rank a SIGTERM meanwhile, so the signal arrives mid-run, on one rank only).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from trainers import dpo, klce, loop, rft, sft

TRAINERS = {"sft": (sft.SFTConfig, sft.train), "dpo": (dpo.DPOConfig, dpo.train), "klce": (klce.KLCEConfig, klce.train),
            "rft": (rft.RFTConfig, rft.train)}


def _hold_rank1(step: int, until: Path, exit_after_s: float | None) -> None:
    if os.environ["RANK"] != "1":
        return
    until.with_suffix(".pid").write_text(str(os.getpid()))
    real, calls = loop._one_step, []

    def held(*args):
        calls.append(1)
        if len(calls) == step:
            until.with_suffix(".held").touch()  # the test signals only once this rank waits here
        start = time.monotonic()
        while len(calls) == step and not until.exists():
            if exit_after_s is not None and time.monotonic() - start > exit_after_s:
                os._exit(3)  # a rank that hung: it never reaches the step's collective
            time.sleep(0.01)
        return real(*args)

    loop._one_step = held


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    for i, job in enumerate(spec["jobs"]):
        if spec.get("hold") and i == len(spec["jobs"]) - 1:
            hold = spec["hold"]
            _hold_rank1(hold["step"], Path(hold["until"]), hold.get("exit_after_s"))
        config_type, train = TRAINERS[job["trainer"]]
        train(config_type.model_validate(job["config"]))


if __name__ == "__main__":
    main()
