"""The research agent: lab configuration, session state, the LangGraph loop, planners and gates.

`agent.config` parses `lab.toml` into typed models; the loop, planners and gates arrive with the
agent issue and read everything they know from the lab notebook (`memory`).
"""
