"""The versions of the packages a job's numbers depend on, as the process that ran it had them installed.

    from core.versions import installed
    installed()  # Versions(torch='2.13.0+cpu', transformers='5.25.0', peft='0.21.2', trl='1.16.0', mamba_ssm=None)

Every job's result carries them (the job wrapper stamps them, tools/jobs/jobrun.py), the model card lists the ones the
nominee was made with, and the GPU session's result records them: a figure is only comparable to another made with the
same versions.
"""

from __future__ import annotations

import importlib.metadata

from pydantic import BaseModel, ConfigDict, Field

# Distribution names, as pip knows them.
PACKAGES = {"torch": "torch", "transformers": "transformers", "peft": "peft", "trl": "trl", "mamba_ssm": "mamba-ssm"}


class Versions(BaseModel):
    """Installed versions of the packages that make or run the weights; None where a package is not installed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    torch: str | None = Field(description="torch's version (its local build tag included, e.g. +cpu, +cu130).")
    transformers: str | None = Field(description="transformers' version.")
    peft: str | None = Field(description="peft's version.")
    trl: str | None = Field(description="trl's version.")
    mamba_ssm: str | None = Field(description="mamba-ssm's version (the fused Mamba kernels), None on a CPU install.")


def installed() -> Versions:
    """The versions installed where this process runs (read from the distributions' metadata, nothing imported)."""
    found = {}
    for field, dist in PACKAGES.items():
        try:
            found[field] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[field] = None
    return Versions(**found)
