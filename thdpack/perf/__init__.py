"""thdpack.perf: how long a context-parallel training step takes on a given machine (numpy only)."""
