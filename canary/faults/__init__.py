"""The fault matrix: every fault of runtime/faults.py through the gates meant to catch it.
`detectors` (which gate catches which fault, with the oracle tags it must name), `matrix` (running
them and the mutation score), `engine_gates` and `gpu_gates` (gates that drive the engine directly)."""
