"""The LLM planner: the same tools offered through Chat Completions tool calling (the `openai`
client, any OpenAI-compatible `base_url` and `model`; the key from the environment variable the lab
names, read once when the planner is built).

Each step sends the protocol (system message), the notebook summary as JSON (agent/summary.py:
aggregates and ids, never battle text), and the reasons its last unusable replies were refused. The
reply must call exactly one tool; its arguments must be a JSON object. What the reply gets wrong comes
back as a `BadReply` (the graph records it, feeds it back, and after 3 in a row takes the playbook's
next step). Tool JSON schemas are generated from the pydantic argument models (agent/toolbox.py).
"""

from __future__ import annotations

import json
import os

import openai

from agent import toolbox
from agent.errors import SessionError
from agent.planners import BadReply, ToolCall
from agent.summary import Summary, without_paths
from core import redact as redaction

SYSTEM = """You plan the next step of a post-training research session. Call exactly one tool per reply.
Protocol: ingest the feedback; register the bars before any eval; calibrate the incumbent (K >= 3) before
comparing; build leak-audited datasets and train one arm per family at conservative settings; evaluate each
candidate at its served decoding; compare it with the incumbent under the bars; promote only what clears
them; stop when the budget runs low or arms keep failing. Artifacts are named by their integer ids.
Put a one-line reason citing the numbers you used in the message content."""


class LLMPlanner:
    """Chat Completions tool calling against an OpenAI-compatible endpoint."""

    name = "openai"

    def __init__(self, client: openai.OpenAI, model: str):
        self.client, self.model = client, model

    @classmethod
    def from_section(cls, section) -> LLMPlanner:
        """From lab.toml's [planner]: base_url, model, api_key_env (the key is read here, once)."""
        key = os.environ.get(section.api_key_env)
        if not key:
            raise SessionError(f"[planner] api_key_env: environment variable {section.api_key_env} is not set")
        redaction.hold(key)
        return cls(openai.OpenAI(base_url=section.base_url, api_key=key, max_retries=0, timeout=120), section.model)

    def messages(self, summary: Summary, feedback: list[str]) -> list[dict]:
        view = summary.render()
        user = "Notebook summary (JSON):\n" + json.dumps(view, sort_keys=True)
        feedback = without_paths(feedback, summary.lab_roots)  # a refusal may quote an outcome line, paths and all
        if feedback:
            user += "\n\nYour previous replies could not be used:\n" + "\n".join(f"- {f}" for f in feedback)
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": redaction.redact(user)}]

    def propose(self, summary: Summary, feedback: list[str]) -> ToolCall | BadReply:
        try:
            reply = self.client.chat.completions.create(model=self.model, messages=self.messages(summary, feedback),
                                                        tools=toolbox.schemas(), tool_choice="auto")
        except openai.OpenAIError as exc:
            # The class and status only: an endpoint's error body is its own text (one that echoes the
            # Authorization header carries the key), and it would be recorded, logged and sent back here.
            status = f" (HTTP {exc.status_code})" if isinstance(exc, openai.APIStatusError) else ""
            return BadReply(reason=f"the endpoint failed: {type(exc).__name__}{status}", raw="")
        if not reply.choices:
            return BadReply(reason="the reply has no choices", raw="")
        message = reply.choices[0].message
        calls = message.tool_calls or []
        if len(calls) != 1:
            return BadReply(reason=f"the reply must call exactly one tool; it called {len(calls)}",
                            raw=(message.content or "")[:200])
        fn = calls[0].function
        try:
            args = json.loads(fn.arguments or "{}")
        except json.JSONDecodeError as exc:
            return BadReply(reason=f"arguments of {fn.name} are not valid JSON: {exc}", raw=f"{fn.name} {fn.arguments}"[:200])
        if not isinstance(args, dict):
            return BadReply(reason=f"arguments of {fn.name} must be a JSON object", raw=f"{fn.name} {fn.arguments}"[:200])
        rationale = (message.content or "").strip().splitlines()
        return ToolCall(tool=fn.name, args=args, rationale=rationale[0][:300] if rationale else f"{self.model} chose {fn.name}")
