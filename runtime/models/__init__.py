"""dsv4-mini: model definition, weight layout and HF-style loading."""
