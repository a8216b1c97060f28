"""The toy world: a complete miniature lab built offline from a seed, with a known oracle (tools/world/build.py)."""
