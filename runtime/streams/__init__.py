"""Declared streams: overlappable work is submitted as tasks with declared reads/writes and
explicit fork/join events, never as ad-hoc stream blocks, so executors and checkers can reason
about ordering."""
