"""dsv4-mini: a compact DeepSeek-V4-style serving runtime, patched and validated by the canary suite."""
