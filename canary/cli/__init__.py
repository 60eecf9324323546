"""`python -m canary` subcommands: `golden` (record/check), `faults` (the fault matrix), `bisect`
(git bisect driven by the golden check; its per-revision step stays at canary/bisect_step.py so
revisions from before this layout still run it)."""
