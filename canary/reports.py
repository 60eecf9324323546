"""Run reports: `summary.json` (every figure, every failure) and PNG plots (the soak's server RSS too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from canary.soak.rss import MIB, Flatness, RssSample, sustained_levels


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


def summary_lines(summary: dict[str, Any], failures: list[str], report_path: Path | None = None,
                  max_failures: int = 25) -> list[str]:
    """What the gate ran and found, for a person at a terminal: target, sessions, requests, tokens,
    the oracles and how many responses each checked, golden N/N (or why not), the differential
    oracle if it ran, perf against the baseline, KV pages, the report path; then the failures.
    The same facts on success and failure, so a pass says what it passed on."""
    m = summary.get("metrics") or {}
    verdict = "PASSED" if not failures else f"FAILED ({len(failures)} failures)"
    target = summary.get("target") or (summary.get("ab") or {}).get("candidate", "?")
    lines = [f"canary gate {verdict}: target {target}"]
    sessions = summary.get("sessions")
    if sessions is not None:
        lines.append(f"  sessions: {sessions} ({summary.get('sessions_completed', 0)} completed, "
                     f"{summary.get('sessions_failed', 0)} failed, {summary.get('sessions_aborted', 0)} aborted)"
                     # calibrated: a session that failed only what it also failed alone went on to its end
                     + (" - failed alone too, see calibration" if summary.get("calibration") and not failures
                        and summary.get("sessions_failed") else ""))
    if m:
        lines.append(f"  requests: {m['requests']} ({m['aborted_requests']} aborted), {m['completion_tokens']} "
                     f"completion tokens in {m['wall_s']:.1f}s = {m['output_tok_s']:.0f} tok/s; TTFT p50 "
                     f"{m['ttft_s']['p50']:.3f}s, TPOT p50 {m['tpot_s']['p50'] * 1000:.1f}ms"
                     + (f"; {m['prompt_tokens']} prompt tokens ({m['prompt_tokens'] / m['completion_tokens']:.0f} per "
                        "completion token)" if m.get("prompt_tokens") and m["completion_tokens"] else ""))
    path = (m or {}).get("critical_path")
    if path and path["between_requests_s"]["count"]:
        lines.append(f"  critical path: the longest session {path['longest_session_s']:.1f}s "
                     f"({path['longest_session_requests']} requests: {path['longest_inside_requests_s']:.1f}s inside "
                     f"them, {path['longest_between_requests_s']:.1f}s between them); between a session's requests "
                     f"p50 {path['between_requests_s']['p50'] * 1000:.0f}ms, p90 "
                     f"{path['between_requests_s']['p90'] * 1000:.0f}ms"
                     + (f"; driver processes started in {m['driver_startup_s']:.1f}s before it (not counted)"
                        if m.get("driver_startup_s") else ""))
    steps = summary.get("engine_steps")
    if steps:
        lines.append(f"  engine: {steps['steps']:.0f} steps, mean {steps['mean_ms']:.1f}ms, in steps "
                     f"{100 * steps['busy']:.0f}% of the run")
    checks = summary.get("oracle_checks") or {}
    if checks:
        lines.append(f"  oracles ({len(checks)}, responses checked): "
                     + ", ".join(f"{name} {count}" for name, count in sorted(checks.items())))
    golden = summary.get("golden")
    if golden:
        diverged = sum(1 for f in failures if f.startswith("[golden]"))
        matched = golden["checked"] - diverged - golden.get("benign_near_ties", 0)
        lines.append(f"  golden: {matched}/{golden['checked']} requests token-identical, "
                     f"{golden.get('benign_near_ties', 0)} benign near-ties, {diverged} diverged ({golden['path']})")
        atol = golden.get("logprob_atol")
        drifted = sum(1 for f in failures if f.startswith("[golden-logprob]"))
        compared = golden.get("logprobs_checked", 0)
        lines.append(f"  golden logprobs: {compared - drifted}/{compared} requests within atol {atol:.0e}"
                     if atol is not None else "  golden logprobs: not compared (the store records none: tokens only)")
    else:
        why = [n for n in summary.get("notes", []) if "golden" in n.lower()]
        lines.append(f"  golden: not checked ({why[0] if why else 'no golden check ran'})")
    differential = summary.get("differential")
    if differential is not None:
        lines.append(f"  differential: {_differential_line(differential)}")
    if summary.get("calibration"):
        lines.append(f"  calibration: {_calibration_line(summary['calibration'])}")
    lines.append(f"  perf: {_perf_line(summary)}")
    pages = summary.get("kv_pages_in_use", "not checked")
    lines.append("  KV pages in use after the run: " + ("skipped (no kv_pages_in_use gauge in /metrics)"
                                                         if pages is None else f"{pages}"))
    if "preemptions" in summary:
        preempted = summary["preemptions"]
        lines.append("  preemptions: " + ("not counted (no dsv4_preemptions_total in /metrics)" if preempted is None
                                          else f"{preempted:.0f} requests preempted and recomputed"))
    if summary.get("prefix_cache"):
        cache = summary["prefix_cache"]
        if not cache["lookup_tokens"]:
            lines.append("  prefix cache: no prefill looked up (off)")
        else:
            lines.append(f"  prefix cache: {cache['hit_tokens']:.0f} of {cache['lookup_tokens']:.0f} prefill tokens "
                         f"from cached pages ({cache['hit_tokens'] / cache['lookup_tokens']:.1%})")
    lines.append(f"  report: {report_path if report_path else 'none written (pass --report-dir)'}")
    if failures:
        lines.append("  failures:")
        lines += [f"    {f}" for f in failures[:max_failures]]
        if len(failures) > max_failures:
            lines.append(f"    ... and {len(failures) - max_failures} more (all in the report)")
    return lines


def _differential_line(differential: dict[str, Any]) -> str:
    """The load-vs-solo oracle's figures (canary/oracles/differential.py): replays identical out of compared,
    near-ties allowed or not, and how long the replays took."""
    mode = "exact" if differential.get("exact") else "near-ties benign"
    skipped = differential.get("skipped")
    if skipped:
        return f"skipped ({skipped})"
    covered = differential.get("compared_alone_in_calibration")
    return (f"{differential.get('equal', 0)}/{differential.get('compared', 0)} replays alone identical to "
            f"under load ({mode}), {differential.get('benign_near_ties', 0)} benign near-ties, "
            f"{differential.get('failed', 0)} failed, {differential.get('wall_s', 0.0):.1f}s"
            + (f"; {covered} requests not replayed: the calibration run ran them alone (see calibration)"
               if covered else ""))


def _calibration_line(calibration: dict[str, Any]) -> str:
    """The calibration run (canary/calibration.py): what failed alone and so is not corruption, and the
    load requests compared with their solo counterparts."""
    alone = calibration.get("failed_alone") or {}
    excused = "; ".join(f"{oracle} in {f['scenarios']}/{calibration['scenarios']} scenarios ({f['label']})"
                        for oracle, f in alone.items() if f["label"]) or "nothing"
    ref = calibration.get("solo_reference") or {}
    mode = "exact" if ref.get("near_tie") is None else "near-ties benign"
    return (f"{calibration['scenarios']} scenarios alone first ({calibration['solo_requests']} requests, "
            f"{calibration['solo_wall_s']:.1f}s); failed alone, not counted as corruption: {excused}; solo reference: "
            f"{ref.get('equal', 0)}/{ref.get('compared', 0)} load requests identical to alone ({mode}), "
            f"{ref.get('benign_near_ties', 0)} benign near-ties, {ref.get('failed', 0)} failed, "
            f"{ref.get('no_counterpart', 0)} without a solo counterpart")


def _verdicts(trials: dict[str, Any]) -> str:
    """Each metric's slowdown with its interval (canary/perf/ratio_stats.py RatioVerdict)."""
    return f"tolerance {trials['tolerance'] * 100:.0f}%; " + "; ".join(
        f"{v['metric']} {(v['ratio'] - 1) * 100:+.1f}% [{(v['low'] - 1) * 100:+.1f}%, {(v['high'] - 1) * 100:+.1f}%] "
        f"over {v['trials']} trials ({v['status']})" if v["trials"] else f"{v['metric']} {v['status']} ({v['reason']})"
        for v in trials["verdicts"])


def _perf_line(summary: dict[str, Any]) -> str:
    gate = summary.get("perf_gate")
    if gate:
        return f"{gate['status']} vs {gate['baseline']}: " + _verdicts(gate)
    ab = summary.get("ab")
    if ab:
        return f"A/B {ab['status']} vs {ab['baseline']}: " + _verdicts(ab)
    why = [n for n in summary.get("notes", []) if "BASELINE" in n or "perf" in n.lower()]
    return f"not gated ({why[0] if why else 'no baseline comparison ran'})"
