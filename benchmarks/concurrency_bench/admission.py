"""--admission (issue 43): N_max with the workers' admission limit pinned, and against the same stack unconfigured.

concurrency.py runs the phases, each level's record tagged with its phase: a stack whose limit is pinned
at --max-n is searched (N_max_pinned: the capacity the stack keeps under the SLO) and stopped; a fresh
stack with no limit configured (the limit starts at the worker's initial one and has to find the
capacity while the level runs) runs one level at 90 % of N_max_pinned, is then searched again, warm
(N_max_unconfigured), and runs overload levels at 2x and 3x N_max_pinned. Here: the worker's gauges
sampled beside each of those levels, what an overload level is judged by, the acceptance, the plot.

An overload level fails the SLO as a level (its refusals are failures). It is judged instead by: no
admitted stream (answered 200) stalled with the buffer, no codec stream failed over during it, and the
share of its clients (a closed-loop stream, by index) whose first audio came within `audio_within_s` of
the client's first request.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from . import metrics
from .load import REFUSED, LevelRun, LoadShape
from .metrics import Targets
from .report import pct, ratio

PINNED, FRESH, WARM = "pinned search", "fresh", "warm search"
OVERLOADS = (2, 3)  # x N_max_pinned
AUDIO_JUDGED_AT = 2  # the overload whose clients must get audio in time
NMAX_RATIO_MIN = 0.9  # unconfigured N_max over pinned N_max, fresh and warm
AUDIO_SHARE_MIN = 0.9
AUDIO_WITHIN_S = 10.0  # at pace 1; divided by the pace (the listener's slow motion)
# What the plot shows, by the worker gauge it reads (summed over the workers); absent on an older worker: None.
GAUGES = {"limit": "megapod_worker_capacity_streams", "admitted": "orpheus_active_streams",
          "decoding": "megapod_worker_decoding_streams", "queued": "megapod_worker_queued_streams",
          "codec_owed_audio_s": "orpheus_codec_owed_audio_seconds_total",  # counters: their differences over time
          "codec_owed_wait_s": "orpheus_codec_owed_wait_seconds_total",
          # frames the engine generated and audio the codec tier gave back: which of the two held a level's opening
          "frames": "orpheus_frames_total", "audio_s": "orpheus_audio_seconds_total"}
FAILOVERS = "orpheus_codec_failovers_total"  # codec streams failed over to another replica: stalled, refused, gone
# Audio the codec tier delivered while streams waited on it, and their waits, summed over the workers: over a level,
# the pace it delivered owed audio at (x real time; the limit grows past its slow start only while the worker's own
# figure, over a quiet span, is capacity.CODEC_ROOM x its target or more).
OWED = ("orpheus_codec_owed_audio_seconds_total", "orpheus_codec_owed_wait_seconds_total")
SAMPLE_S = 0.5

Read = Callable[..., Awaitable[dict[str, float]]]  # LocalStack.worker_metrics: names -> sums (nan: unreadable)


def fresh_n(n_pinned: int) -> int:
    """The fresh stack's one level: the fewest streams that are NMAX_RATIO_MIN of N_max_pinned (a pass shows the
    criterion's ratio, no more; the fresh stack has no search of its own, which would warm it)."""
    return max(1, math.ceil(NMAX_RATIO_MIN * n_pinned - 1e-9))


def overload_phase(factor: int) -> str:
    return f"overload {factor}x"


def overload_shape(shape: LoadShape, audio_within_s: float) -> LoadShape:
    """An overload level's shape: the window stays open until every client has had `audio_within_s` since its
    first request, and the level's time limit moves out by as much."""
    window = max(shape.window_s, shape.stagger_s + audio_within_s)
    return replace(shape, window_s=window, max_level_s=shape.max_level_s + window)


# -- the worker's gauges beside a level ----------------------------------------------------------


async def sampled(read: Read, level: Awaitable[LevelRun], period_s: float = SAMPLE_S) -> tuple[LevelRun, dict]:
    """Run `level` with the worker's gauges read every `period_s` beside it; returns the run and its figures:
    the gauges' series (seconds from the level's start), the codec failovers over the level and the pace the codec
    delivered owed audio at over it (x real time)."""
    before = await read(FAILOVERS, *OWED)
    rows: list[tuple[float, dict[str, float]]] = []
    poller = asyncio.create_task(_poll(read, rows, period_s))
    try:
        run = await level
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    after = await read(FAILOVERS, *OWED)
    failovers, audio_s, wait_s = (after[name] - before[name] for name in (FAILOVERS, *OWED))
    owed_pace = audio_s / wait_s if wait_s > 0 else math.nan
    return run, {"gauges": series(rows, run.t0, period_s), "codec_failovers": None if math.isnan(failovers) else
                 round(failovers), "codec_owed_pace": _finite(round(owed_pace, 3))}


async def _poll(read: Read, rows: list[tuple[float, dict[str, float]]], period_s: float) -> None:
    due = time.perf_counter()
    while True:
        t = time.perf_counter()
        rows.append((t, await read(*GAUGES.values())))
        due = max(due + period_s, time.perf_counter())  # a slow scrape delays the next, never bunches them
        await asyncio.sleep(due - time.perf_counter())


def series(rows: Sequence[tuple[float, dict[str, float]]], t0: float, period_s: float) -> dict[str, Any]:
    """The samples as one list per gauge (compact in the JSON), times in seconds from `t0`; nan -> None."""
    out: dict[str, Any] = {"period_s": period_s, "t": [round(t - t0, 2) for t, _ in rows]}
    for key, name in GAUGES.items():
        out[key] = [_finite(values.get(name, math.nan)) for _, values in rows]
    return out


def _finite(x: float) -> float | int | None:
    if not math.isfinite(x):
        return None
    return int(x) if x == int(x) else round(x, 3)


# -- what an overload level is judged by ---------------------------------------------------------


def overload_figures(run: LevelRun, targets: Targets, audio_within_s: float) -> dict[str, Any]:
    """Over every request of the level (counted or not): admitted ones that ran dry at the buffer, refusals, and
    the share of clients with audio within `audio_within_s`."""
    admitted, over = admitted_over_buffer(run, targets)
    return {"admitted_requests": admitted, "admitted_over_buffer": over,
            "refused_requests": sum(r.status in REFUSED for r in run.requests),
            "statuses": dict(Counter(str(r.status) for r in run.requests)),
            "clients": run.n, "clients_audio_within_s": audio_within_s,
            "clients_audio_within_share": clients_audio_within_share(run, audio_within_s)}


def admitted_over_buffer(run: LevelRun, targets: Targets) -> tuple[int, int]:
    """(admitted requests, those whose playback stalled with the buffer). A stream cut open at the level's end is
    judged on the chunks it got: when exactly it was cut is not known closely enough to judge its last silence."""
    admitted = [r for r in run.requests if r.status == 200]
    dry = sum(metrics.ran_dry(r.timeline(), targets.buffer_s, targets.pace) for r in admitted)
    return len(admitted), dry


def clients_audio_within_share(run: LevelRun, within_s: float) -> float | None:
    """The share of the level's clients whose first audio (of any of their requests) came within `within_s` of
    their first request; a client that never sent one counts as without."""
    first_sent: dict[int, float] = {}
    first_audio: dict[int, float] = {}
    for r in run.requests:
        first_sent[r.stream] = min(first_sent.get(r.stream, r.sent_s), r.sent_s)
        t = r.timeline().first_audio_s
        if t is not None:
            first_audio[r.stream] = min(first_audio.get(r.stream, t), t)
    within = sum(s in first_audio and first_audio[s] - first_sent[s] <= within_s + metrics.EPS for s in first_sent)
    return round(within / run.n, 4) if run.n else None


# -- the outcome ---------------------------------------------------------------------------------


def outcome(levels: Sequence[dict], pinned: dict, warm: dict, audio_within_s: float) -> dict[str, Any]:
    """The mode's figures from its tagged level records and the two searches' summaries (summarize()'s rows)."""
    fresh = _phase(levels, FRESH)
    overloads = {k: _phase(levels, overload_phase(k)) for k in OVERLOADS}
    n_pinned = pinned["n_max"]
    ratios = {"fresh": ratio(fresh["n"], n_pinned) if fresh["passed"] else None, "warm": ratio(warm["n_max"], n_pinned)}
    return {"n_max_pinned": n_pinned, "n_max_unconfigured_warm": warm["n_max"], "pinned_search": pinned,
            "fresh": brief(fresh), "warm_search": warm, "ratios_unconfigured_over_pinned": ratios,
            "overload": {overload_phase(k): brief(r) for k, r in overloads.items()},
            "passed_with_admitted_over_buffer": passed_over_buffer(levels),
            "acceptance": acceptance(n_pinned, fresh, warm["n_max"], overloads, audio_within_s)}


def passed_over_buffer(levels: Sequence[dict]) -> dict[str, list[dict]]:
    """The searches' levels that passed though admitted streams ran past the buffer: a level is judged on the streams
    sent while its window was open, and those its clients sent after it (as streams ended, beside the rest: the
    load a worker keeps, not one burst) are judged only here."""
    return {phase: [{k: r[k] for k in ("n", "run", "admitted_requests", "admitted_over_buffer")}
                    for r in levels if r.get("phase") == phase and r["passed"] and r.get("admitted_over_buffer")]
            for phase in (PINNED, WARM)}


def acceptance(n_pinned: int, fresh: dict, n_warm: int, overloads: dict[int, dict],
               audio_within_s: float) -> dict[str, Any]:
    """Issue 43's criteria, each a verdict with its figures, and whether all hold."""
    warm_ratio = ratio(n_warm, n_pinned)
    criteria = {
        # the fresh stack ran one level, at fresh_n(N_max_pinned): passing it is that ratio at least
        "fresh_n_max_ratio": {"passed": bool(n_pinned and fresh["passed"] and fresh["n"] >= NMAX_RATIO_MIN * n_pinned),
                              "at_least": NMAX_RATIO_MIN, "ratio": ratio(fresh["n"], n_pinned) if fresh["passed"] else None,
                              "n_max_pinned": n_pinned, "level_n": fresh["n"], "level_passed": fresh["passed"]},
        "warm_n_max_ratio": {"passed": warm_ratio is not None and warm_ratio >= NMAX_RATIO_MIN,
                             "at_least": NMAX_RATIO_MIN, "ratio": warm_ratio, "n_max_unconfigured": n_warm,
                             "n_max_pinned": n_pinned},
    }
    for k, r in overloads.items():
        criteria[f"{k}x_no_admitted_over_buffer"] = {
            "passed": r["admitted_over_buffer"] == 0, "n": r["n"], "admitted_over_buffer": r["admitted_over_buffer"],
            "admitted_requests": r["admitted_requests"]}
        criteria[f"{k}x_no_codec_failover"] = {  # None: the worker does not export the counter
            "passed": r["codec_failovers"] == 0, "n": r["n"], "codec_failovers": r["codec_failovers"]}
    share = overloads[AUDIO_JUDGED_AT]["clients_audio_within_share"]
    criteria[f"{AUDIO_JUDGED_AT}x_clients_audio_within"] = {
        "passed": share is not None and share >= AUDIO_SHARE_MIN, "at_least": AUDIO_SHARE_MIN, "share": share,
        "within_s": audio_within_s, "n": overloads[AUDIO_JUDGED_AT]["n"]}
    return {"passed": all(c["passed"] for c in criteria.values()), "criteria": criteria}


BRIEF = ("n", "passed", "reasons", "ended_by", "wall_s", "success_share", "realtime_share", "ttfa_s",
         "required_buffer_s", "admitted_requests", "admitted_over_buffer", "refused_requests", "clients",
         "clients_audio_within_share", "codec_failovers", "codec_owed_pace")


def brief(record: dict) -> dict[str, Any]:
    """A level's headline figures, and where its admission limit started, ended and peaked."""
    limits = [v for v in (record.get("gauges") or {}).get("limit", []) if v is not None]
    return {**{k: record.get(k) for k in BRIEF}, "limit_first": limits[0] if limits else None,
            "limit_last": limits[-1] if limits else None, "limit_max": max(limits, default=None)}


def _phase(levels: Sequence[dict], phase: str) -> dict:
    return next(r for r in levels if r.get("phase") == phase)


def figures_line(r: dict) -> str:
    """An admission level's figures beside its level_line."""
    return (f"    admitted {r['admitted_requests']} (over the buffer {r['admitted_over_buffer']}), refused "
            f"{r['refused_requests']}, clients with audio within {r['clients_audio_within_s']:g} s "
            f"{pct(r['clients_audio_within_share'])}, codec failovers {_n(r.get('codec_failovers'))}, codec owed audio "
            f"at {_n(r.get('codec_owed_pace'))}x real time")


def summary_text(block: dict) -> str:
    ratios, fresh = block["ratios_unconfigured_over_pinned"], block["fresh"]
    lines = [f"limit pinned: N_max {block['n_max_pinned']}",
             (f"unconfigured, fresh stack: N={fresh['n']} {'PASS' if fresh['passed'] else 'FAIL'} (limit "
              f"{_n(fresh['limit_first'])} -> {_n(fresh['limit_last'])}), ratio {_n(ratios['fresh'])}"),
             f"unconfigured, warm stack: N_max {block['n_max_unconfigured_warm']}, ratio {_n(ratios['warm'])}"]
    for phase, r in block["overload"].items():
        lines.append(f"{phase} (N={r['n']}): admitted over the buffer {r['admitted_over_buffer']}/"
                     f"{r['admitted_requests']}, codec failovers {_n(r['codec_failovers'])}, clients with audio in "
                     f"time {pct(r['clients_audio_within_share'])}, refused {r['refused_requests']}")
    for phase, passed in block["passed_with_admitted_over_buffer"].items():
        if passed:
            lines.append(f"{phase}: passed with admitted streams over the buffer (after its window): " + ", ".join(
                f"N={r['n']} {r['admitted_over_buffer']}/{r['admitted_requests']}" for r in passed))
    verdicts = ", ".join(f"{k} {'ok' if c['passed'] else 'NO'}" for k, c in block["acceptance"]["criteria"].items())
    lines.append(f"acceptance: {'PASS' if block['acceptance']['passed'] else 'FAIL'} ({verdicts})")
    return "\n".join(lines)


def _n(x: Any) -> str:
    return "n/a" if x is None else f"{x:g}"


# -- the plot ------------------------------------------------------------------------------------

LINES = (("limit", "admission limit"), ("admitted", "admitted streams"), ("decoding", "decoding streams"),
         ("queued", "queued requests"))


def plot(levels: Sequence[dict], n_pinned: int, path: str, title: str) -> str:
    """Limit, admitted, decoding and queued streams over time on the unconfigured stack: the fresh level, then
    the warm search and the overloads, each panel's levels back to back (boundaries dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("fresh stack", [r for r in levels if r.get("phase") == FRESH]),
              ("warm stack: search, then overload",
               [r for r in levels if r.get("phase") == WARM or str(r.get("phase")).startswith("overload")])]
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), dpi=100)
    for ax, (label, rows) in zip(axes, panels):
        offset = 0.0
        for j, r in enumerate(rows):
            g = r.get("gauges") or {"t": []}
            ts = [offset + t for t in g["t"]]
            for i, (key, name) in enumerate(LINES):
                values = [math.nan if v is None else v for v in g.get(key, [None] * len(ts))]
                ax.plot(ts, values, color=f"C{i}", linewidth=1.2, label=name if j == 0 else None,
                        drawstyle="steps-post")
            ax.axvline(offset, color="gray", linestyle=":", linewidth=0.8)
            ax.text(offset, 0.98, f" {_tag(r)}N={r['n']} {'pass' if r['passed'] else 'fail'}",
                    transform=ax.get_xaxis_transform(), rotation=90, va="top", fontsize=7, color="dimgray")
            offset += max(r["wall_s"], ts[-1] - offset if ts else 0.0)
        ax.axhline(n_pinned, color="gray", linestyle="--", linewidth=0.8, label=f"pinned N_max ({n_pinned})")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("seconds (levels back to back)")
        ax.set_ylabel("streams")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))  # outside: the levels' labels are inside
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def _tag(r: dict) -> str:
    """A level's label on the plot: its phase, but for the search's own levels."""
    return "" if r["phase"] == WARM else r["phase"].removeprefix("overload ") + " "
