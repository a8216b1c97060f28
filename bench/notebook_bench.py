"""Notebook throughput: decision appends per second and `verify` time on a 100,000-decision notebook.

    .venv/bin/python bench/notebook_bench.py [--decisions 100000] [--out bench/results/notebook.json]

Each append is its own committed transaction (what the agent does), with a ~200-byte payload.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from memory.notebook import Notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/notebook.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Notebook.open(Path(tmp) / "notebook.db") as nb:
        nb.open_session("bench", lab=tmp, budget_gpuh=1, reserve_gpuh=0, planner="playbook", executor="local",
                        config={})
        payload = {"tool": "train", "args": {"lr": 1e-5, "steps": 400, "data": "a" * 64}, "note": "b" * 64}
        start = time.perf_counter()
        for i in range(args.decisions - 1):
            nb.record_decision("bench", "plan", "benchmark append", {**payload, "i": i})
        append_s = time.perf_counter() - start
        start = time.perf_counter()
        report = nb.verify()
        verify_s = time.perf_counter() - start
        assert report.ok and report.count == args.decisions, report
        size = (Path(tmp) / "notebook.db").stat().st_size
    result = {
        "command": f"python bench/notebook_bench.py --decisions {args.decisions}",
        "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}",
        "decisions": args.decisions,
        "append_per_s": round((args.decisions - 1) / append_s),
        "verify_s": round(verify_s, 3),
        "db_mb": round(size / 2**20, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
