"""The one lab paths object: every file and directory a session writes, derived from the lab root.

Tool arguments never carry paths (they speak in artifact ids and intent); a tool asks `LabPaths`
where its outputs go, and names them by content so that the same step always lands in the same
place (which is what makes a job's idempotency key stable across resume and replay).

    paths = LabPaths(root=Path("lab"))
    paths.run("sft-3f2a9c01")        # lab/runs/sft-3f2a9c01
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class LabPaths(BaseModel):
    """Paths of one lab directory (submitit's JobPaths, for a whole lab)."""

    model_config = ConfigDict(frozen=True)
    root: Path = Field(description="The lab directory (holds lab.toml, the notebook and all outputs).")

    @property
    def notebook(self) -> Path:
        return self.root / "notebook.db"

    @property
    def graph_checkpoints(self) -> Path:
        """LangGraph's SQLite checkpointer file: its own file, never the notebook."""
        return self.root / "graph.sqlite"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def splits(self) -> Path:
        return self.root / "splits"

    def dataset(self, name: str) -> Path:
        return self.root / "data" / f"{name}.jsonl"

    def run(self, name: str) -> Path:
        return self.root / "runs" / name

    def evaluation(self, name: str) -> Path:
        return self.root / "evals" / name

    def merged(self, name: str) -> Path:
        return self.root / "merges" / name

    def bundle(self, name: str) -> Path:
        return self.root / "bundles" / name

    def inside(self, path: str | Path) -> bool:
        """Whether `path` (absolute, or relative to the lab) resolves inside the lab directory."""
        p = Path(path)
        resolved = (p if p.is_absolute() else self.root / p).resolve()
        return resolved.is_relative_to(self.root.resolve())
