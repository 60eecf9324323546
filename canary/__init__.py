"""The canary harness: targets, session driver, oracles, perf gate, golden store, bisect, reports."""
