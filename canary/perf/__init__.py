"""Speed: `metrics` (TTFT/TPOT/ITL/tok/s of a run), `verdict` (against a stored baseline or an A/B
baseline server, the step-time fit and bucket cliffs), `machine_speed` (the probe that scales a CPU
baseline to the machine the run landed on)."""
