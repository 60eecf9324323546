"""The oracles: pure checks of what a server answered. `turn` (one response against its scenario:
JSON, schema, grounding, nonces, stream protocol), `golden` (transcripts against the golden store),
`differential` (load vs solo replays), `logprob_close` (the one near-tie rule), `tolerances` and
`topk_compare` (kernel outputs against their references)."""
