"""Prefill/decode disaggregation: a prefill server computes a prompt's KV and first token and writes
the KV pages into a decode server's pool through a transfer engine (Mooncake, TCP on CPU); the
decode server continues. `transfer` moves pages, `bootstrap` pairs the two sides (sessions, rooms,
timeouts), `prefill` and `decode` are each side's glue to the server, `router` fronts the pair."""
