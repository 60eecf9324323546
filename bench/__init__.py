"""GPU benchmarks; each runs as `python -m bench.NAME` from the checkout. Results go to docs/results.md."""
