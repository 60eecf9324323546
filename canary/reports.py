"""Run reports: `summary.json` (every figure, every failure) and PNG plots (the soak's server RSS too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from canary.rss import MIB, Flatness, RssSample, sustained_levels


def write_summary(report_dir: Path, summary: dict[str, Any]) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    path = report_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return path


def write_plots(report_dir: Path, summary: dict[str, Any]) -> list[Path]:
    """Throughput and TPOT vs concurrency, the step-time fit, and failures over time (those with data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report_dir.mkdir(parents=True, exist_ok=True)
    written = []
    levels = summary.get("sweep", [])
    if levels:
        conc = [lv["concurrency"] for lv in levels]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(conc, [lv["output_tok_s"] for lv in levels], marker="o")
        ax1.set(xlabel="concurrency", ylabel="output tok/s", title="throughput")
        ax2.plot(conc, [lv["tpot_s"]["p50"] * 1000 for lv in levels], marker="o")
        ax2.set(xlabel="concurrency", ylabel="TPOT p50 (ms)", title="time per output token")
        for cliff in summary.get("cliffs", []):
            ax1.axvline(cliff["to"], color="red", alpha=0.4)
        fig.tight_layout()
        written.append(_save(fig, report_dir / "throughput_vs_concurrency.png"))
    fit = summary.get("step_fit")
    if fit and fit.get("points"):
        xs, ys = zip(*fit["points"])
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.scatter(xs, [y * 1000 for y in ys], label="measured")
        ax.plot(xs, [(fit["a"] + fit["b"] * x) * 1000 for x in xs], color="black",
                label=f"a={fit['a'] * 1000:.2f} ms, b={fit['b'] * 1000:.3f} ms/req")
        ax.set(xlabel="batch size (concurrency)", ylabel="step time (ms)", title="step = a + b*bs")
        ax.legend()
        written.append(_save(fig, report_dir / "step_time_fit.png"))
    failures = summary.get("failures", [])
    if failures:
        fig, ax = plt.subplots(figsize=(6, 3))
        times = sorted(f.get("t", 0.0) for f in failures)
        ax.step(times, range(1, len(times) + 1), where="post")
        ax.set(xlabel="seconds into the run", ylabel="failures (cumulative)", title="failures over time")
        written.append(_save(fig, report_dir / "failures_over_time.png"))
    return written


def write_rss_plot(report_dir: Path, samples: list[RssSample], flatness: Flatness) -> Path:
    """Server RSS over the run: against time, and against work done with its sustained level (the
    rolling median the flatness check uses), the end of the warm-up and the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report_dir.mkdir(parents=True, exist_ok=True)
    mib = [s.rss_bytes / MIB for s in samples]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([s.t_s for s in samples], mib)
    ax1.set(xlabel="seconds into the run", ylabel="server RSS (MiB)", title="server memory over time")
    progress = [s.progress for s in samples]
    ax2.plot(progress, mib, color="lightgray", label="sampled every 2 s")
    ax2.plot(progress, [level / MIB for level in sustained_levels(samples, flatness.window_s)], color="black",
             label=f"sustained ({flatness.window_s:.0f} s rolling median)")
    ax2.axvline(flatness.warmup_progress, color="gray", linestyle=":",
                label=f"end of warm-up ({flatness.warmup_fraction:.0%})")
    ax2.axhline((flatness.warmup_level_bytes + flatness.bound_bytes) / MIB, color="red", linestyle="--",
                label=f"warm-up level + {flatness.bound_bytes / MIB:.0f} MiB bound")
    ax2.set(xlabel="requests completed", ylabel="server RSS (MiB)",
            title=f"sustained growth after warm-up {flatness.growth_bytes / MIB:+.1f} MiB")
    ax2.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return _save(fig, report_dir / "rss.png")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
