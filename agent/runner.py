"""Starting and resuming a session: the lab (lab.toml) becomes the tools' LabSpec, the session is
opened in the notebook, the live objects are built, and the graph is driven to its end.

    start(lab_dir, session, budget_gpuh, ...)   # run_agent.py run
    resume(lab_dir, session, ...)               # run_agent.py resume SESSION
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver

from agent.closing import open_session, require_verified
from agent.config import LAB_FILE, LabConfig, base_license, load_lab_config
from agent.errors import SessionError
from agent.graph import Runtime, check_checkpoint, drive
from agent.live import reporter
from agent.planners import Planner, recipes
from agent.planners.playbook import Playbook, PlaybookSettings
from core import redact as redaction
from core.display import shown
from core.util import sha256_text
from evals.job import CallableJudgeSpec, OpenAIJudgeSpec
from evals.judge import JudgePolicy
from memory.notebook import ChatTemplateRef, Notebook
from memory.records import ReconfigurePayload
from memory.skips import skipped_steps
from memory.state import fold
from tools.context import LabSpec, LabSuite, LabTruth, ToolContext
from tools.data.datasets import ReplaySource, VerifiedSource
from tools.jobs.accounts import accounts_line, session_accounts
from tools.jobs.executor import ExecutorSection, ResourcesSection, local_gpus
from tools.jobs.launcher import Launcher, Resources
from tools.paths import LabPaths, portable
from tools.promote import start_incumbent


def chat_template_ref(tokenizer_dir: Path) -> ChatTemplateRef:
    """The lab tokenizer's chat format (core.chat.chat_format: its own template, or ChatML when it has none;
    the end-of-turn token and stop ids derived from it); SessionError with the reason when the template
    cannot be trained with, so such a lab is refused before a session opens."""
    from core import chat, loading
    from core.template_bounds import tokenizer_template_problem

    try:
        tokenizer = loading.load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as err:
        raise SessionError(f"{tokenizer_dir}: the tokenizer does not load ({type(err).__name__}); expected a "
                           "transformers tokenizer directory") from None
    bounds = tokenizer_template_problem(tokenizer)  # rendered in a bounded child before this process renders it
    if bounds is not None:
        raise SessionError(f"{tokenizer_dir}: chat template: {bounds}; no session was opened")
    try:
        fmt = chat.chat_format(tokenizer)
    except chat.ChatTemplateError as err:
        raise SessionError(f"{tokenizer_dir}: chat template: {err}; no session was opened") from None
    return ChatTemplateRef(source=fmt.source, sha256=sha256_text(fmt.template), system_turns=fmt.system_turns,
                           masking=fmt.masking, eot_token=fmt.eot_token, stop_token_ids=fmt.stop_token_ids)


def _judge(config: LabConfig) -> OpenAIJudgeSpec | CallableJudgeSpec | None:
    """The pairwise judge of judge suites: the toy world's oracle, or an OpenAI-compatible endpoint."""
    j = config.judge
    if j.kind == "oracle":
        return CallableJudgeSpec(kind="callable", target="tools.world.oracle:judge")
    if j.kind == "openai":
        return OpenAIJudgeSpec(kind="openai", base_url=j.base_url, model=j.model, api_key_env=j.api_key_env,
                               policy=JudgePolicy(concurrency=j.concurrency, retries=j.retries,
                                                  max_error_share=j.max_error_share,
                                                  max_unparsed_share=j.max_unparsed_share))
    return None  # a reward model scores the judge suites as reward_proxy suites instead (lab_spec)


# Scorers that read the session's holdout battles when their suite names no file.
HOLDOUT_SCORERS = {"judge", "battle_margin", "reward_proxy"}


def _suite_scorer(config: LabConfig, scorer: str) -> str:
    """[judge] kind = 'reward_model' scores the judge suites with the reward model: the candidate's answer against
    the parent's recorded one on the holdout's decisive battles, a reward-proxy win rate (evals/reward_proxy.py)."""
    return "reward_proxy" if scorer == "judge" and config.judge.kind == "reward_model" else scorer


def lab_spec(config: LabConfig, chat_ref: ChatTemplateRef | None = None) -> LabSpec:
    """The tools' view of a lab config; `chat_ref`: its tokenizer's chat format as already read (at the session's
    opening, or as the session recorded it), else read here."""
    parent = config.model.parent or config.model.base
    tokenizer = config.model.tokenizer or parent
    judge = _judge(config)
    license_text, license_source = base_license(config.model)
    suites = [LabSuite(name=e.name, scorer=_suite_scorer(config, e.scorer), file=e.file, sealed=e.sealed,
                       constraint_mode=e.constraint_mode)
              for e in config.evals if e.file is not None or e.scorer in HOLDOUT_SCORERS]
    if not any(not s.sealed for s in suites):
        raise SessionError("lab.toml: [[evals]] needs at least one open (not sealed) suite it can score")
    return LabSpec(
        parent=parent, tokenizer=tokenizer, feedback=config.feedback.file, dev_fraction=config.feedback.dev_fraction,
        sealed_fraction=config.feedback.sealed_fraction, stratify_by=config.feedback.stratify_by,
        reserve_fraction=config.feedback.reserve_fraction, suites=suites,
        replicates=max(e.replicates for e in config.evals),
        data=[ReplaySource(name=d.name, path=d.path, cap=d.cap) for d in config.data if d.kind == "chat"],
        verified=[VerifiedSource(name=d.name, path=d.path, verifier=d.verifier)
                  for d in config.data if d.kind == "verified"], bars=config.bars,
        reward_model=config.judge.path if config.judge.kind == "reward_model" else None,
        served=config.serving.served_decoding(tuple((chat_ref or chat_template_ref(tokenizer)).stop_token_ids)),
        judge=judge,
        time_limit_min=config.executor.time_limit_min, model_name=parent.name,
        eval_batch_size=config.executor.eval_batch_size, gpu_dtype=config.executor.gpu_dtype,
        job_resources={kind: config.executor.kind_resources(kind, local_gpus(os.environ))
                       for kind in ResourcesSection.model_fields},
        truth=LabTruth(**config.truth.model_dump()) if config.truth else None,
        base_license=license_text, base_license_source=license_source, train=config.train_recipe(),
    )


def make_planner(kind: str, config: LabConfig, playbook: Playbook) -> Planner:
    if kind == "openai":
        from agent.planners.llm import LLMPlanner

        return LLMPlanner.from_section(config.planner)
    return playbook


def minute_cost(launcher: Launcher):
    """One minute of a job's time-limit bound (simulated charge included): the most a minute of it can cost, whatever
    the job's forecast (a forecast from its tokens once stood in here, so jobs kept the lab's whole time limit)."""
    def cost(r: Resources) -> float:
        return launcher.run_bound(r.model_copy(update={"time_limit_min": 1.0})).gpuh
    return cost


def _runtime(nb: Notebook, session: str, lab_dir: Path, config: LabConfig, executor: ExecutorSection,
             settings: PlaybookSettings, planner_kind: str, quiet: bool, chat_ref: ChatTemplateRef | None = None
             ) -> Runtime:
    # The keys the lab names are redacted from every message from here on, used or not (core/redact.py).
    redaction.hold_env(os.environ, {config.planner.api_key_env, config.judge.api_key_env})
    paths = LabPaths(root=lab_dir, session=session)
    launcher = Launcher.from_section(nb, session, executor, paths.jobs,
                                     lab_roots=paths.spellings(nb.session(session).lab))
    ctx = ToolContext(nb=nb, session=session, paths=paths, lab=lab_spec(config, chat_ref), jobs=launcher,
                      minute_gpuh=minute_cost(launcher))
    playbook = Playbook(settings)
    return Runtime(ctx=ctx, planner=make_planner(planner_kind, config, playbook), playbook=playbook, forecaster=launcher,
                   reporter=reporter(paths.notebook, session, quiet), max_failed_arms=settings.max_failed_arms)


class RedactingSerializer(JsonPlusSerializer):
    """LangGraph's serializer with the one redaction applied first (core/redact.py): graph.sqlite is written
    like the notebook, never holding a secret the process holds (the state is plain JSON and ids)."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return super().dumps_typed(redaction.redact_data(obj))


def _checkpointer(path: Path, use: Callable[[SqliteSaver], Any]) -> None:
    # Its own file: the notebook stays the one source of truth, the checkpoint file is disposable. The state is plain
    # JSON and ids, so the serializer reads back no other type (LangGraph's strict msgpack allow-list: a checkpoint
    # naming a class is not rebuilt into one).
    conn = sqlite3.connect(str(path), check_same_thread=False)
    try:
        use(SqliteSaver(conn, serde=RedactingSerializer(allowed_msgpack_modules=None)))
    finally:
        conn.close()


def _drive_checkpointed(rt: Runtime) -> None:
    _checkpointer(rt.ctx.paths.graph_checkpoints, lambda saver: drive(rt, saver))


def _check_checkpoints(path: Path) -> None:
    """A damaged graph checkpoint file is refused before anything is written (the session is not opened)."""
    if not path.exists():
        return
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            conn.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:
        raise SessionError(f"{path}: the graph checkpoint is not a readable SQLite database ({exc}); it holds "
                           "nothing the notebook lacks: remove it, and resume rebuilds the session from the "
                           "notebook") from None


def closing_line(nb: Notebook, session: str) -> str:
    """The session's status line: its status, and how many planned steps it skipped (part of how it ended)."""
    skipped = skipped_steps(nb, session)
    return (f"session {session}: {nb.session(session).status}"
            + (f", {len(skipped)} planned step(s) skipped (the report lists them)" if skipped else "")
            + f"; notebook {nb.path}")


def _finish(rt: Runtime) -> int:
    rt.reporter.close()
    nb, session = rt.ctx.nb, rt.ctx.session
    s, state = nb.session(session), fold(nb, session)
    nominee = nb.artifact(state.nominee) if state.nominee is not None else None
    print(shown(closing_line(nb, session)))  # paths name the lab, whose name is a user's choice: printed escaped
    if nominee is not None:
        print(shown(f"nominee: {nominee.name} ({nominee.path})"))
    ledger = state.ledger
    print(f"budget: {ledger.spent_gpuh:.4f} of {ledger.budget_gpuh:g} GPU-h spent (reserve {ledger.reserve_gpuh:g})")
    print(accounts_line(session_accounts(nb, session)))
    print(shown(f"review: python run_agent.py verify --lab {rt.ctx.paths.root}; datasette {nb.path}"))
    return 0 if s.status == "done" else 1


# The one lab.toml section a resume may change: where and how jobs run (a partition that cannot hold them, a time
# limit), never what the session measures, trains on or decides by.
RESUMABLE_CHANGES = frozenset({"executor"})


def lab_changes(saved: dict[str, Any], recorded_lab: str, config: LabConfig, paths: LabPaths) -> dict[str, Any]:
    """The top-level lab.toml sections whose settings differ from those a session recorded (`saved`, with its lab
    root `recorded_lab`), paths inside the lab compared lab-relative: the same lab reached by another spelling, from
    another directory, copied or moved, has no changes. {section: its settings now}."""
    before = portable(saved, paths.spellings(recorded_lab))  # read from the notebook at the lab's current place
    now = portable(config.model_dump(mode="json"), paths.spellings(recorded_lab))
    return {k: now.get(k) for k in sorted(before.keys() | now.keys()) if before.get(k) != now.get(k)}


def accept_lab_changes(nb: Notebook, session: str, config: LabConfig, paths: LabPaths) -> ChatTemplateRef | None:
    """What a resume accepts of a lab.toml edited since the session started: [executor] changes (a partition that
    could not hold its jobs, a time limit), recorded as a `reconfigure` decision; anything else is SessionError,
    since the session's measurements, bars and data would no longer be the ones it decided by. So is a chat template
    other than the one the session opened with (its rows, evals and bundle are rendered with it). Returns the lab's
    chat format as read now (None: the session recorded none)."""
    s = nb.session(session)
    changed = lab_changes(s.config["lab"], s.lab, config, paths)
    if set(changed) - RESUMABLE_CHANGES:
        raise SessionError(f"{paths.root}/lab.toml changed since session {session} started (" + ", ".join(
            f"[{k}]" for k in changed) + "); resume accepts changes to [executor] only: restore the rest")
    # What run checked before the session opened, checked again on the lab as it is now (an [executor] edited since:
    # GPUs or memory this host or partition lacks; an unset key variable): LabConfigError before anything is recorded.
    from agent.inputs import require_inputs

    require_inputs(config, paths.root / LAB_FILE, os.environ, s.planner, s.executor)
    opened = fold(nb, session).opened
    recorded = opened.chat_template if opened is not None else None
    chat_ref = None
    if recorded is not None:
        tokenizer = config.model.tokenizer or config.model.parent or config.model.base
        chat_ref = chat_template_ref(tokenizer)
        if chat_ref.sha256 != recorded.sha256:
            raise SessionError(f"{shown(str(tokenizer))}: the chat template changed since session {session} started "
                               f"(sha256 {recorded.sha256[:12]} then, {chat_ref.sha256[:12]} now); the session's rows, "
                               "evals and bundle are rendered with the one it opened with: restore it")
    if changed:
        record_reconfigure(nb, session, s.config["lab"], changed)
    return chat_ref


def record_reconfigure(nb: Notebook, session: str, saved: dict[str, Any], changed: dict[str, Any]) -> None:
    """A resume on changed [executor] settings is a decision, once per change: before (as the session last ran),
    after (from now on)."""
    for section, after in changed.items():
        earlier = [d for d in nb.decisions(session, kind="reconfigure") if d.payload.section == section]
        before = earlier[-1].payload.after if earlier else saved.get(section) or {}
        if before != after:
            nb.record_decision(session, "reconfigure", f"resumed with changed [{section}] settings: "
                               + ", ".join(sorted(k for k in after.keys() | before.keys()
                                                  if after.get(k) != before.get(k))),
                               ReconfigurePayload(section=section, before=before, after=after))


def snapshot(config: LabConfig, protocol: str, settings: PlaybookSettings) -> dict[str, Any]:
    return {"lab": config.model_dump(mode="json"), "protocol": protocol, "playbook": settings.model_dump(mode="json")}


def lab_facts(config: LabConfig) -> dict[str, Any]:
    """What the recipes read of a lab: its judge kind, its chat and verified data, its battle-margin suite and how
    many bars it registers (agent/planners/recipes.py)."""
    from evals import bars as bars_file

    margin = [e.name for e in config.evals if e.scorer == "battle_margin" and not e.sealed]
    verified = [d.name for d in config.data if d.kind == "verified"]
    return {"judge": config.judge.kind, "chat_data": any(d.kind == "chat" for d in config.data),
            "verified_pool": verified[0] if verified else None, "margin_suite": margin[0] if margin else None,
            "bars": len(bars_file.load(config.bars).bar) if config.bars is not None else 0}


def policy_of(config: LabConfig, protocol: str, recipe: str | None) -> PlaybookSettings:
    """The session's named policy: the combined playbook at the protocol's sizes, or a seed's recipe; a recipe the
    lab cannot run is refused (SessionError saying what to add) before any session opens."""
    name = recipe or config.playbook.recipe
    facts = lab_facts(config)
    if name == "combined":  # its RFT arm samples the lab's own verified pool, or is skipped without one
        return PlaybookSettings.named(protocol, facts["verified_pool"])
    missing = recipes.problems(name, facts)
    if missing:
        raise SessionError(f"recipe {name} cannot run in this lab: " + "; ".join(missing) + "; no session was opened")
    return recipes.settings(name, protocol, facts)


def start(lab_dir: Path, session: str, budget_gpuh: float, planner: str, executor: str, protocol: str,
          quiet: bool, recipe: str | None = None) -> int:
    """Open a new session in the lab and drive it to a nomination."""
    # Resolved once, here: every path the session records is then absolute, whatever directory a later
    # resume, replay or job runs from.
    lab_dir = lab_dir.resolve()
    config = load_lab_config(lab_dir)
    _check_checkpoints(LabPaths(root=lab_dir).graph_checkpoints)
    settings = policy_of(config, protocol, recipe)
    section = config.executor.model_copy(update={"kind": executor})
    chat_ref = chat_template_ref(config.model.tokenizer or config.model.parent or config.model.base)
    with Notebook.open(LabPaths(root=lab_dir).notebook) as nb:
        require_verified(nb, "run")  # its first decision would chain rows added outside the agent
        nb.open_session(session, lab=str(lab_dir), budget_gpuh=budget_gpuh,
                        reserve_gpuh=budget_gpuh * config.budget.reserve_fraction, planner=planner,
                        executor=executor, config=snapshot(config, protocol, settings), policy=settings.ref(),
                        chat_template=chat_ref)
        rt = _runtime(nb, session, lab_dir, config, section, settings, planner, quiet, chat_ref)
        start_incumbent(rt.ctx)
        _drive_checkpointed(rt)
        return _finish(rt)


def resume(lab_dir: Path, session: str, quiet: bool) -> int:
    """Continue a session that died: from its last graph checkpoint, or rebuilt from the notebook."""
    lab_dir = lab_dir.resolve()
    paths = LabPaths(root=lab_dir)
    if not paths.notebook.exists():
        raise SessionError(f"{paths.notebook}: no notebook here (pass --lab DIR)")
    config = load_lab_config(lab_dir)
    _check_checkpoints(paths.graph_checkpoints)
    with Notebook.open(paths.notebook) as nb:
        s = open_session(nb, session, "resume")
        if paths.graph_checkpoints.exists():  # nothing from graph.sqlite is trusted: checked before anything is written
            _checkpointer(paths.graph_checkpoints,
                          lambda saver: check_checkpoint(nb, session, paths.graph_checkpoints, saver))
        saved = s.config
        chat_ref = accept_lab_changes(nb, session, config, paths)
        settings = PlaybookSettings.recorded(saved["playbook"], session)
        section = config.executor.model_copy(update={"kind": s.executor})
        rt = _runtime(nb, session, lab_dir, config, section, settings, s.planner, quiet, chat_ref)
        # Jobs the dead agent left pending or running are settled first (one whose process is gone is lost), so the
        # interrupted step is gated on what they spent, not on a reservation no process holds; its re-attach then
        # runs a lost job again, admitted against the budget.
        for job in rt.forecaster.settle_orphans():
            rt.reporter.event(f"resume: job {job.kind} {job.key[:12]} attempt {job.attempt} ended while the agent "
                              f"was gone: {job.state}" + (f" ({job.failure_class})" if job.failure_class else ""))
        start_incumbent(rt.ctx)
        _drive_checkpointed(rt)
        return _finish(rt)
