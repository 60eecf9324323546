"""CUDA-graph decode: a static-shape decode model, per-bucket capture and replay, eager fallback."""
