"""Training the canary model: synthetic tool-use corpus, tokenizer, differentiable forward, loop.

Modules: tools (tool set, JSON schemas, deterministic local execution), corpus (seeded sessions),
template (the chat template + its marker strings), tokenizer_train (BPE), encode (sessions -> token
ids + loss masks), data (length-bucketed batches), model (training forward = the inference math,
differentiable), loop (phases, optimiser), __main__ (`python -m runtime.train`). The evaluation
(runtime/eval_canary.py) parses tool calls with the server's parser, runtime/server/dsml.py.
"""
