"""Served decoding: how a candidate answers when it ships.

Invariant 4 of DESIGN.md: candidates are evaluated with the decoding, system prompt and template
they would ship with. `Decoding` is that contract; its `fingerprint()` is what an eval records so a
comparison can refuse evals made under any other decoding.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Decoding(BaseModel):
    """Generation settings a candidate is served with (and therefore evaluated with)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system_prompt: str = Field("", description="System prompt prepended to every conversation; empty for none.")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="Sampling temperature; 0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; ignored under greedy decoding.")
    repetition_penalty: float = Field(1.0, ge=1.0, le=3.0, description="CTRL-style repetition penalty; 1.0 is off.")
    max_new_tokens: int = Field(512, ge=1, le=262144, description="Hard cap on generated tokens per answer.")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end an answer (end-of-turn, eos).")

    @model_validator(mode="after")
    def _greedy_has_no_top_p(self) -> Decoding:
        # Greedy decoding with top_p < 1 is a contradiction a server would silently ignore.
        if self.temperature == 0.0 and self.top_p != 1.0:
            raise ValueError("top_p must be 1.0 under greedy decoding (temperature = 0)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def fingerprint(self) -> str:
        """sha256 of the canonical settings: two evals share served decoding iff fingerprints match."""
        canon = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()
