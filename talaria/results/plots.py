"""PNG figures for a run: the SCT distribution per policy and a timeline of
the slowest sessions (calls, tool gaps, waits). Matplotlib, headless."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from talaria.results.records import CallRecord  # noqa: E402


def sct_cdf(runs: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        v = sorted(s["sct_s"] for s in r["sessions"])
        if not v:
            continue
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=f"{r['policy']} (p50 {r['sct_p50_s']:.0f} s)")
    ax.set_xlabel("session completion time (model seconds)")
    ax.set_ylabel("fraction of sessions")
    ax.set_title("SCT distribution per policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def session_timeline(policy: str, records: list[CallRecord], run: dict, path: Path, n: int = 6) -> Path:
    """For the n slowest sessions: per call, its wait (grey), switch part of it
    (orange), prefill/restore (blue) and decode (green); gaps are tool time."""
    slow = [s["session_id"] for s in sorted(run["sessions"], key=lambda s: -s["sct_s"])[:n]]
    by_session: dict[str, list[CallRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(slow) + 1.5))
    for y, sid in enumerate(slow):
        for r in by_session.get(sid, []):
            start = r.issued_at
            wait = r.waited_s
            ax.broken_barh([(start, wait - r.switch_wait_s)], (y - 0.35, 0.7), color="#bbbbbb")
            ax.broken_barh([(start + wait - r.switch_wait_s, r.switch_wait_s)], (y - 0.35, 0.7), color="#f0a030")
            busy = r.restore_s + r.prefill_s
            ax.broken_barh([(start + wait, busy)], (y - 0.35, 0.7), color="#3070c0")
            ax.broken_barh([(start + wait + busy, max(0.0, r.finished_at - start - wait - busy))], (y - 0.35, 0.7), color="#40a040")
    ax.set_yticks(range(len(slow)), slow)
    ax.set_xlabel("model seconds since the run started (gaps between bars: tool time)")
    ax.set_title(f"{policy}: slowest sessions — wait (grey), switch (orange), prefill/restore (blue), decode (green)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(runs: list[dict], records_by_policy: dict[str, list[CallRecord]], out_dir: str | Path) -> list[Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [sct_cdf(runs, d / "sct-distribution.png")]
    for r in runs:
        recs = records_by_policy.get(r["policy"], [])
        if recs:
            paths.append(session_timeline(r["policy"], recs, r, d / f"timeline-{r['policy']}.png"))
    return paths
