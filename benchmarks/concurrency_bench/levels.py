"""One level run turned into its record: verdict, p50/p95/p99 figures, throughput, raw timelines."""

from __future__ import annotations

from collections import Counter
from itertools import takewhile
from typing import Any

from . import metrics
from .load import LevelRun, Request
from .metrics import Targets


def level_record(run: LevelRun, targets: Targets, gpus: int | None) -> dict[str, Any]:
    """The verdict and figures of one run of one level (counted requests only)."""
    counted = run.counted
    end = run.t0 + run.wall_s
    timelines = [r.timeline() for r in counted]
    counts = metrics.count(timelines, targets, end)  # exact once all ended; open ones: what is certain
    reasons = counts.over(targets) if run.ended_by == "failed early" else metrics.verdict(timelines, targets)
    ended = [(r, tl) for r, tl in zip(counted, timelines) if not tl.open]
    figs = [metrics.stream_figures(tl, targets, r.audible_offset) for r, tl in ended]
    ok = [f for f in figs if f["ok"]]
    # A level that failed early still says how late first audio was and how much buffer its open
    # streams needed by then (a lower bound), so a failing level shows by how much it failed.
    opened = [(r, tl) for r, tl in zip(counted, timelines) if tl.open]
    live = [{"ttfa_s": metrics.time_to_first_audio(tl), "ttfa_audible_s": metrics.time_to_offset(tl, r.audible_offset),
             "required_buffer_s": _need_so_far(tl, targets.pace, end)} for r, tl in opened]
    gaps = [g for _, tl in ended for g in metrics.gaps_s(tl.chunks)]
    rate = throughput(run)
    per_gpu = None if not gpus else round(rate["audio_s_per_s"] / gpus, 4)

    def pct(key: str, rows: list[dict]) -> dict[str, float | None]:
        return metrics.percentiles((f[key] for f in rows), digits=4)

    return {
        "endpoint": run.endpoint, "n": run.n, "run": run.run, "mode": run.mode,
        "passed": not reasons, "reasons": reasons, "ended_by": run.ended_by,
        "wall_s": round(run.wall_s, 2),
        "window_s": [round(run.window_open_s, 2), None if run.window_close_s is None else round(run.window_close_s, 2)],
        "streams_counted": len(counted), "streams_ended": len(ended), "streams_cut_open": len(counted) - len(ended),
        "requests_sent": len(run.requests),
        # Over every counted stream; after an early failure the open ones count as fine (upper bounds).
        "success_share": _share(counts.streams - counts.failed, counts.streams),
        "realtime_share": _share(counts.streams - counts.not_real_time, counts.streams),
        "ttfa_within_target_share": _share(counts.streams - counts.slow_first_audio, counts.streams),
        "truncated": sum(f["truncated"] for f in figs),
        "errors": dict(Counter(_error_kind(f["error"]) for f in figs if not f["ok"])),
        "ttfa_s": pct("ttfa_s", figs + live),
        "ttfa_audible_s": pct("ttfa_audible_s", figs + live),
        "required_buffer_s": pct("required_buffer_s", ok + live),
        "rtf": pct("rtf", ok),
        "stall_share": _share(sum(f["stall_count"] > 0 for f in ok), len(ok)),
        # Over every counted stream, as realtime_share: an ended one that failed or had a longer gap misses; after an
        # early failure the open ones count as fine (upper bounds).
        "continuity_share": {_slo(t): _share(counts.streams - sum(not (f["ok"] and f["worst_gap_s"] <= t + metrics.EPS)
                                                                  for f in figs), counts.streams)
                             for t in metrics.GAP_SLOS_S},
        "worst_gap_s": pct("worst_gap_s", ok),
        "gap_s": {**metrics.percentiles(gaps, digits=4), "max": round(max(gaps), 4) if gaps else None},
        "audio_s_per_stream": pct("audio_s", ok),
        **rate,
        "audio_s_per_s_per_gpu": per_gpu,
        "client": {"loop_lag_ms": run.loop_lag_ms, "cpu_cores": round(run.client_cpu_cores, 3)},
    }


def _slo(threshold_s: float) -> str:
    return f"{round(threshold_s * 1000)}ms"


def n_max_within_gap_slos(levels: list[dict], targets: Targets) -> dict[str, int]:
    """Per continuity SLO, the largest N whose every run, and every run of each level below it, met it with success
    and first audio as the level's own pass does: the SLO read off the levels the search ran (it is driven by the
    buffer criterion, so a level above its boundary may not have been run)."""
    out = {}
    for t in metrics.GAP_SLOS_S:
        met: dict[int, bool] = {}
        for r in levels:
            good = (r["continuity_share"][_slo(t)] >= targets.realtime_share - metrics.EPS
                    and r["success_share"] >= targets.success_share - metrics.EPS
                    and r["ttfa_within_target_share"] >= targets.ttfa_quantile - metrics.EPS)
            met[r["n"]] = met.get(r["n"], True) and good
        out[_slo(t)] = max(takewhile(met.get, sorted(met)), default=0)
    return out


def _need_so_far(tl: metrics.Timeline, pace: float, now: float) -> float | None:
    """The buffer an open stream has needed up to `now`: what its chunks needed, or the silence it is in."""
    first = tl.first_audio_s
    if first is None:
        return None
    return max(metrics.required_buffer_s(tl.chunks, pace), now - first - tl.audio_s / pace)


def throughput(run: LevelRun) -> dict[str, Any]:
    """Audio delivered per second, by every stream, while the counted requests ran.

    The span runs from the first counted request sent to the last one ended (or the level's end);
    streams keep the load on throughout, so this is the level's steady output.
    """
    counted = run.counted
    level_end = run.t0 + run.wall_s
    if not counted:
        return {"span_s": None, "audio_s_per_s": 0.0, "chunks_per_s": 0.0, "mean_in_flight": None}
    start = min(r.sent_s for r in counted)
    stop = max(r.ended_s if r.ended_s is not None else level_end for r in counted)
    span = max(stop - start, 1e-9)
    audio_bytes = chunks = 0
    busy = 0.0
    for r in run.requests:
        inside = [(t, n) for t, n in r.chunks if start <= t <= stop]
        audio_bytes += sum(n for _, n in inside)
        chunks += len(inside)
        busy += max(0.0, min(r.ended_s if r.ended_s is not None else level_end, stop) - max(r.sent_s, start))
    return {"span_s": round(span, 3), "audio_s_per_s": round(audio_bytes / metrics.BYTES_PER_AUDIO_S / span, 4),
            "chunks_per_s": round(chunks / span, 2), "mean_in_flight": round(busy / span, 2)}


def jsonl_rows(run: LevelRun) -> list[dict[str, Any]]:
    """The raw per-chunk timeline of every request of a run, times in seconds from the level's start."""
    return [_row(run, r) for r in run.requests]


def _row(run: LevelRun, r: Request) -> dict[str, Any]:
    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - run.t0, 4)

    return {"endpoint": run.endpoint, "n": run.n, "run": run.run, "stream": r.stream, "seq": r.seq,
            "utterance": r.utterance, "counted": r.counted, "sent_s": rel(r.sent_s), "status": r.status,
            "ended_s": rel(r.ended_s), "completed": r.completed, "cut": r.cut, "error": r.error,
            "audible_offset_bytes": r.audible_offset, "chunks": [[rel(t), n] for t, n in r.chunks]}


def _error_kind(error: str | None) -> str:
    if not error:
        return "no audio or truncated"
    return error.split(":", 1)[0][:40]


def _share(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None

