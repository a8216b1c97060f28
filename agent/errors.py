"""The agent's one error for the command line: a session that cannot be started, resumed or replayed
as asked (exit status 2, nothing written). Kept apart so that run_agent.py can catch it without
importing the loop."""


class SessionError(Exception):
    """A session that cannot be started, resumed or replayed as asked."""
