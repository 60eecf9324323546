"""Training the canary model: synthetic tool-use corpus, tokenizer, differentiable forward, loop.

Modules: tools (tool set, JSON schemas, deterministic local execution), corpus (seeded sessions),
template (the chat template + rendering), tokenizer_train (BPE), encode (sessions -> token ids +
loss masks), model (training forward = the inference math, differentiable), loop (phases, optimiser),
dsml (a small DSML tool-call parser), __main__ (`python -m runtime.train`).
"""
