"""The report's jobs table says where each model job ran: device (and ranks), dtype, device name, tokens/s, read
from the job's recorded result (an eval's placement, an RFT run's train result's)."""

from __future__ import annotations

import re
from pathlib import Path

from memory.notebook import Notebook
from memory.report import write_report


def test_jobs_table_shows_device_dtype_device_name_and_throughput(tmp_path: Path) -> None:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=1.0, reserve_gpuh=0.0, planner="playbook",
                    executor="local", config={})
    placed = {"device": "cuda", "dtype": "bfloat16", "device_name": "NVIDIA H200", "devices": 2, "tokens_per_s": 5123.4}
    results = {"eval": {"placement": placed},
               "rft": {"train": {"placement": placed | {"devices": 1, "tokens_per_s": 812.0}}},
               "merge": {"path": "merged"}}  # a job without a model records no placement
    for kind, result in results.items():
        nb.start_job(f"k-{kind}", session="s1", kind=kind, executor="local", resources={}, forecast_gpuh=0.0)
        nb.update_job(f"k-{kind}", 1, state="completed", result=result, gpu_hours=0.01)
    nb.close()
    _, out = write_report(tmp_path / "notebook.db", "s1", tmp_path / "report.html")
    html = out.read_text()
    section = re.search(r'<section id="jobs">.*?</section>', html, re.DOTALL).group(0)
    header = section.split("</tr>")[0]
    for column in ("device", "dtype", "device name", "tokens/s"):
        assert f">{column}<" in header
    rows = {kind: re.search(rf"<td>{kind}</td>.*?</tr>", section, re.DOTALL).group(0) for kind in results}
    assert "<td>cuda x2</td><td>bfloat16</td><td>NVIDIA H200</td><td>5123.4</td>" in rows["eval"]
    assert "<td>cuda</td><td>bfloat16</td><td>NVIDIA H200</td><td>812</td>" in rows["rft"]
    assert "<td></td><td></td><td></td><td></td>" in rows["merge"]
