"""Concurrency benchmark: how many voice streams one GPU keeps in real time, and the latency they get.

Drives any OpenAI-compatible POST /v1/audio/speech (`--url`), or starts this stack locally with
`megapod up` (`--policy streaming`, the default when no URL is given). For each concurrency level
N: N closed-loop streams (each sends a request, reads it to its end, sends the next) start
staggered, a warm-up is not counted, and the requests sent in the measuring window are the
sample. Every chunk's arrival and audio bytes are timed on the client's clock. A level passes
when >= 99 % of its streams succeed, p95 time to first audio is within the target, and >= 99 %
of them never run dry with the buffer B. The search doubles N until a level fails, bisects, and
repeats both sides of the boundary. Two targets (two URLs, two policies, or one of each) are
measured interleaved level by level, and the ratios printed. A client-headroom check then drives
a trivial endpoint with several times the heaviest load, to show the client was not the limit.

`--admission` (issue 43) measures the workers' own admission instead: N_max searched on a stack
whose limit is pinned, then on a fresh one unconfigured (one level at 90 % of that N_max, while its
limit is still finding the capacity), on it warm (a search), and at 2x and 3x that N_max, the workers'
limit, admitted, decoding and queued streams sampled beside every level; it writes the ratios and
issue 43's acceptance into <prefix>.json, and <prefix>-admission.png (concurrency_bench/admission.py).

Writes <prefix>.json (metadata and one record per level), <prefix>.jsonl (every request's chunk
timeline) and <prefix>-{ttfa,realtime,throughput}.png. Targets, windows and defaults: see
benchmarks/README.md. Run from the repository root:

    .venv/bin/python benchmarks/concurrency.py --quick                        # CPU smoke, < 10 min
    .venv/bin/python benchmarks/concurrency.py --quick --policy streaming --policy reference
    .venv/bin/python benchmarks/concurrency.py --url http://10.0.0.5:8000 --gpus 8
    .venv/bin/python benchmarks/concurrency.py --quick --admission            # pinned vs unconfigured
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import provenance
from benchmarks.concurrency_bench import admission, report
from benchmarks.concurrency_bench.corpus import DEFAULT_CORPUS, Corpus, load_corpus
from benchmarks.concurrency_bench.headroom import headroom_check
from benchmarks.concurrency_bench.levels import jsonl_rows, level_record, n_max_within_gap_slos
from benchmarks.concurrency_bench.load import Endpoint, Level, LevelRun, LoadShape, warm_up
from benchmarks.concurrency_bench.metrics import BYTES_PER_AUDIO_S, Targets
from benchmarks.concurrency_bench.search import Search
from benchmarks.concurrency_bench.stack import LocalStack, cpu_cores, cpu_snapshot

# The search finds N_max, so the workers' admission must not: every stack started here admits a fixed
# --max-n streams a worker, whatever --megapod-args say (unset, each worker measures its own limit and
# refuses past it).
FIXED_LIMIT = "--min-streams-per-worker {n} --max-streams-per-worker {n}"
# --quick is the full benchmark in slow motion for a 2-core CPU running the tiny model: the
# listener plays at 0.1x real time and every time target is 10x the GPU default. Short turns only,
# no per-level warm-up (the stack is warmed once), a window that closes as soon as every stream
# has sent one counted request, and levels that fail end at once.
FULL = {"pace": 1.0, "ttfa_target_s": 0.5, "buffer_s": 0.3, "kinds": "short,medium,long", "stagger_s": 3.0,
        "warmup_s": 10.0, "window_s": 60.0, "max_n": 1024, "max_levels": 40, "max_level_s": 900.0,
        "warmup_requests": 2, "headroom_seconds": 20.0, "megapod_args": ""}
QUICK = {"pace": 0.1, "ttfa_target_s": 5.0, "buffer_s": 3.0, "kinds": "short", "stagger_s": 2.0,
         "warmup_s": 0.0, "window_s": 0.0, "max_n": 16, "max_levels": 12, "max_level_s": 150.0,
         "warmup_requests": 1, "headroom_seconds": 8.0, "megapod_args": "--replicas 1 --enforce-eager true"}
# --admission is measured at `megapod up`'s defaults (two codec replicas, also under --quick), eager on a CPU.
ADMISSION_MEGAPOD_ARGS = "--enforce-eager true"
# --admission --quick's searches may run 16 levels, not 12: issue 43's run 31 ran out of them after the pinned 36
# passed and 38, 37 and 36 again failed, with nothing between 32 and 36 run (N_max 32, the ratios' baseline).
ADMISSION_QUICK_LEVELS = 16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("targets (two of them: a comparison)")
    t.add_argument("--url", action="append", default=[], help="an existing endpoint's base URL (repeatable)")
    t.add_argument("--policy", action="append", default=[], choices=("streaming", "reference"),
                   help="start `megapod up --codec-policy P` here, on free ports (repeatable; default streaming "
                        "when no --url)")
    t.add_argument("--megapod-args", default=None,
                   help=f"more `megapod up` flags for every stack started (default {FULL['megapod_args']!r}; "
                        f"--quick {QUICK['megapod_args']!r}; --admission {ADMISSION_MEGAPOD_ARGS!r})")
    t.add_argument("--name", action="append", default=[], help="labels of the targets, in order (urls, then policies)")
    t.add_argument("--gpus", action="append", type=int, default=[],
                   help="GPUs each target uses, every tier counted (default: a started stack's own; none for a URL)")
    t.add_argument("--model", default="orpheus")
    t.add_argument("--voice", default="tara")
    t.add_argument("--response-format", default="pcm", choices=("pcm", "wav"))
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    t.add_argument("--no-seed", action="store_true", help="do not send `seed` (for servers that refuse it)")
    g = p.add_argument_group("targets a level must meet")
    g.add_argument("--quick", action="store_true", help="CPU smoke run, < 10 min on 2 cores (see the module doc)")
    g.add_argument("--pace", type=float, help="playback speed streams must keep up with, x real time (default 1; "
                                               "--quick 0.1)")
    g.add_argument("--ttfa-target-s", type=float, help="p95 time to first audio (default 0.5; --quick 5)")
    g.add_argument("--buffer-s", type=float, help="playout buffer B a real-time stream may use (default 0.3; --quick 3)")
    g.add_argument("--success-share", type=float, default=0.99)
    g.add_argument("--realtime-share", type=float, default=0.99)
    s = p.add_argument_group("load and search")
    s.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    s.add_argument("--kinds", help="utterance kinds (default short,medium,long; --quick short)")
    s.add_argument("--seed", type=int, default=1234, help="corpus order and request seeds")
    for name, help_ in (("stagger-s", "stream starts spread over this"), ("warmup-s", "not counted"),
                        ("window-s", "measuring window (and until every stream sent a counted request)"),
                        ("max-level-s", "counted requests still open then fail")):
        s.add_argument(f"--{name}", type=float, help=f"{help_} (default {FULL[name.replace('-', '_')]:g}; "
                                                     f"--quick {QUICK[name.replace('-', '_')]:g})")
    s.add_argument("--settle-s", type=float, default=2.0, help="pause between levels")
    s.add_argument("--read-timeout-s", type=float, default=120.0)
    s.add_argument("--start-n", type=int, default=1)
    s.add_argument("--max-n", type=int)
    s.add_argument("--max-levels", type=int, help="level runs per target at most")
    s.add_argument("--confirm-runs", type=int, default=1, help="repeats of each side of the boundary")
    s.add_argument("--warmup-requests", type=int, help="sequential requests per target before the search")
    s.add_argument("--poisson-check", action="store_true",
                   help="after the search, one open-loop level per target at the arrival rate of its N_max")
    s.add_argument("--poisson-window-s", type=float, default=120.0)
    a = p.add_argument_group("admission (issue 43): the workers' limit pinned, against it unconfigured")
    a.add_argument("--admission", action="store_true",
                   help="search N_max on a stack with the limit pinned at --max-n, then on a fresh one unconfigured: "
                        "one level at 90%% of that N_max, a search (warm), and levels at 2x and 3x it (streaming policy)")
    a.add_argument("--audio-within-s", type=float,
                   help="an overload level's clients should get audio within this of their first request "
                        f"(default {admission.AUDIO_WITHIN_S:g} s / --pace)")
    o = p.add_argument_group("client headroom and output")
    o.add_argument("--headroom-streams", type=int, default=0, help="0: 4x the largest N run, at least 32")
    o.add_argument("--headroom-seconds", type=float)
    o.add_argument("--no-headroom", action="store_true")
    o.add_argument("--out-prefix", type=Path,
                   help="default benchmarks/results/concurrency-<device>[-a-vs-b|-admission][-quick]")
    o.add_argument("--keep-logs", action="store_true", help="keep the stacks' logs (their directory is printed)")
    args = p.parse_args(argv)
    if args.admission:
        if args.url or set(args.policy) - {"streaming"} or args.poisson_check:
            p.error("--admission starts its own stacks (streaming policy) and runs its own levels")
        args.policy = ["streaming"]
        if args.megapod_args is None:
            args.megapod_args = ADMISSION_MEGAPOD_ARGS
        if args.quick and args.max_levels is None:
            args.max_levels = ADMISSION_QUICK_LEVELS
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.url and not args.policy:
        args.policy = ["streaming"]
    if len(args.url) + len(args.policy) > 2:
        p.error("one target, or two to compare")
    if args.admission and args.audio_within_s is None:
        args.audio_within_s = admission.AUDIO_WITHIN_S / args.pace
    return args


@dataclass
class Target:
    """One endpoint under test, the stack behind it if we started it, and its search."""

    name: str
    endpoint: Endpoint
    search: Search
    stack: LocalStack | None = None
    gpus: int | None = None
    levels: list[dict] = field(default_factory=list)
    # --admission: the phase its levels are part of now (tags their records and timelines); its workers'
    # gauges are sampled beside each of them
    phase: str | None = None


def build_targets(args: argparse.Namespace, log_dir: Path) -> list[Target]:
    names = iter(args.name)
    gpus = iter(args.gpus)
    out, taken = [], set()
    for url in args.url:
        name = next(names, f"url{len(out) + 1}")
        out.append(Target(name, _endpoint(args, name, url), _search(args), gpus=next(gpus, None)))
    for policy in args.policy:
        name = next(names, policy)
        out.append(stack_target(args, name, [*FIXED_LIMIT.format(n=args.max_n).split(), "--codec-policy", policy],
                                log_dir, taken, next(gpus, None)))
    if len({t.name for t in out}) != len(out):
        raise SystemExit("targets need distinct names (--name)")
    return out


def admission_targets(args: argparse.Namespace, log_dir: Path) -> list[Target]:
    """--admission's two stacks, alike but for the pinned limit: [unconfigured, pinned] (the ratios' order)."""
    taken: set[int] = set()
    gpus = next(iter(args.gpus), None)
    pinned = stack_target(args, "pinned", [*FIXED_LIMIT.format(n=args.max_n).split(), "--codec-policy", "streaming"],
                          log_dir, taken, gpus)
    return [stack_target(args, "unconfigured", ["--codec-policy", "streaming"], log_dir, taken, gpus), pinned]


def stack_target(args: argparse.Namespace, name: str, flags: list[str], log_dir: Path, taken: set[int],
                 gpus: int | None) -> Target:
    """A `megapod up` with --megapod-args and `flags`, its ports chosen apart from `taken`."""
    stack = LocalStack(name, [*shlex.split(args.megapod_args), *flags], log_dir)
    stack.plan(taken)
    return Target(name, _endpoint(args, name, stack.url), _search(args), stack, gpus)


def _endpoint(args: argparse.Namespace, name: str, url: str) -> Endpoint:
    return Endpoint(name, url.rstrip("/"), args.model, args.voice, args.response_format, args.api_key,
                    not args.no_seed)


def _search(args: argparse.Namespace, start: int | None = None) -> Search:
    return Search(start or args.start_n, args.max_n, args.confirm_runs, args.max_levels)


def warm_search(args: argparse.Namespace, fresh: dict) -> Search:
    """The warm search starts at the fresh level when it passed: doubling from 1 again spent half of --quick's 12
    levels below it (issue 43's run 28: 32 passed, then failed its repeat, and no level was left for 17-31: N_max 16)."""
    return _search(args, fresh["n"] if fresh["passed"] else None)


# -- running ----------------------------------------------------------------------------------


async def run_search(args: argparse.Namespace, targets: list[Target], corpus: Corpus, rt: Targets, shape: LoadShape,
                     jsonl: Any) -> list[dict]:
    """Every target warmed up, then searched."""
    await warm_up_targets(args, targets, corpus)
    return await search_levels(args, targets, corpus, rt, shape, jsonl)


async def warm_up_targets(args: argparse.Namespace, targets: Sequence[Target], corpus: Corpus) -> None:
    for target in targets:
        t0 = time.perf_counter()
        await warm_up(target.endpoint, [u.text for u in corpus.utterances[: args.warmup_requests]], 1,
                      args.read_timeout_s)
        print(f"[{target.name}] warmed up: {args.warmup_requests} requests in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)


async def search_levels(args: argparse.Namespace, targets: list[Target], corpus: Corpus, rt: Targets,
                        shape: LoadShape, jsonl: Any) -> list[dict]:
    """Every target's search, interleaved level by level (ABBA order, so drift hits both alike)."""
    levels, round_ = [], 0
    while any(not t.search.done for t in targets):
        for target in targets if round_ % 2 == 0 else targets[::-1]:
            n = target.search.next_level()
            if n is None:
                continue
            record, _ = await run_level(args, target, targets, n, len(target.search.runs.get(n, [])) + 1, corpus,
                                        rt, shape, jsonl)
            target.search.record(n, record["passed"])
            levels.append(record)
        round_ += 1
    return levels


async def run_level(args: argparse.Namespace, target: Target, targets: Sequence[Target], n: int, run: int,
                    corpus: Corpus, rt: Targets, shape: LoadShape, jsonl: Any,
                    fail_early: bool = True) -> tuple[dict, LevelRun]:
    """One level run measured and printed, then the stack left to drain and settle."""
    record, level_run = await measure(target, targets, n, run, corpus, rt, shape, jsonl, fail_early)
    record["request_s_mean"] = _mean_duration(level_run)
    target.levels.append(record)
    print(report.level_line(record), flush=True)
    if target.stack:  # the cancelled requests of this level must not load the next one
        record["idle_wait_s"] = round(await target.stack.wait_idle(), 2)
    await asyncio.sleep(args.settle_s)
    return record, level_run


async def measure(target: Target, targets: Sequence[Target], n: int, run: int, corpus: Corpus, rt: Targets,
                  shape: LoadShape, jsonl: Any, fail_early: bool = True) -> tuple[dict, LevelRun]:
    """One level run: its record with the cores every started stack used, its timelines written to `jsonl`."""
    stacks = [t.stack for t in targets if t.stack]
    before = cpu_snapshot(stacks)
    level = Level(target.endpoint, shape, rt, corpus, n, run, fail_early=fail_early).run_level()
    if target.phase:  # --admission: the workers' gauges beside the level, their codec failovers over it
        level_run, sampled = await admission.sampled(target.stack.worker_metrics, level)
    else:
        level_run, sampled = await level, {}
    record = level_record(level_run, rt, target.gpus)
    after = cpu_snapshot(stacks)
    record["cores"] = cpu_cores(before, after)
    if target.stack:  # this level's codec CPU over all the audio its requests got
        codec_s = after["stacks"][target.stack.name]["codec"] - before["stacks"][target.stack.name]["codec"]
        audio_s = sum(n for r in level_run.requests for _, n in r.chunks) / BYTES_PER_AUDIO_S
        record["codec_cpu_s"], record["audio_s"] = round(codec_s, 3), round(audio_s, 3)
    tag = {} if shape.mode == "closed" else {"mode": shape.mode}
    if target.phase:
        tag["phase"] = target.phase
        admitted, over = admission.admitted_over_buffer(level_run, rt)  # the streams after its window too
        record.update({"phase": target.phase, "admitted_requests": admitted, "admitted_over_buffer": over, **sampled})
    for row in jsonl_rows(level_run):
        jsonl.write(json.dumps({**row, **tag}, separators=(",", ":")) + "\n")
    return record, level_run


def _mean_duration(level_run: LevelRun) -> float | None:
    done = [r.ended_s - r.sent_s for r in level_run.counted if r.ended_s is not None and r.completed]
    return round(sum(done) / len(done), 3) if done else None


async def poisson_checks(args: argparse.Namespace, targets: list[Target], corpus: Corpus, rt: Targets,
                         shape: LoadShape, jsonl: Any) -> list[dict]:
    """Open loop at lambda = N_max / mean request time at N_max (Little's law): does it hold there too?"""
    out = []
    for target in targets:
        n_max = target.search.n_max
        at = [r for r in target.levels if r["n"] == n_max and r["passed"] and r["request_s_mean"]]
        if not at:
            out.append({"endpoint": target.name, "skipped": "no passing level to derive a rate from"})
            continue
        rate = n_max / at[-1]["request_s_mean"]
        open_shape = LoadShape(**{**asdict(shape), "mode": "poisson", "rate": rate,
                                  "window_s": args.poisson_window_s})
        record, _ = await measure(target, targets, n_max, 1, corpus, rt, open_shape, jsonl)
        record["arrival_rate_per_s"] = round(rate, 4)
        print(f"[{target.name}] Poisson at {rate:.3f}/s (N_max {n_max}): mean in flight {record['mean_in_flight']}\n  "
              + report.level_line(record), flush=True)
        out.append(record)
    return out


def run_admission(args: argparse.Namespace, targets: Sequence[Target], corpus: Corpus, rt: Targets, shape: LoadShape,
                  jsonl: Any) -> list[dict]:
    """--admission's phases (concurrency_bench/admission.py), one stack at a time: the pinned one searched and
    stopped, then the unconfigured one fresh, searched warm and overloaded."""
    unconfigured, pinned = targets
    _enter(pinned, admission.PINNED, f"N_max with the limit pinned at {args.max_n}")
    start_stacks([pinned])
    levels = asyncio.run(run_search(args, [pinned], corpus, rt, shape, jsonl))
    pinned.stack.stop()
    start_stacks([unconfigured])
    n_pinned = max(pinned.search.n_max, 1)  # with none passing, the comparison fails; its levels still say how
    return levels + asyncio.run(unconfigured_phases(args, unconfigured, n_pinned, corpus, rt, shape, jsonl))


async def unconfigured_phases(args: argparse.Namespace, target: Target, n_pinned: int, corpus: Corpus, rt: Targets,
                              shape: LoadShape, jsonl: Any) -> list[dict]:
    """90 % of N_max_pinned at once on the fresh stack (only warmed up: its limit still at the worker's initial one), the
    search on it warm, then 2x and 3x N_max_pinned (refusals fail them as levels: they run their course)."""
    await warm_up_targets(args, [target], corpus)
    n_fresh = admission.fresh_n(n_pinned)
    _enter(target, admission.FRESH, f"{n_fresh} streams at once ({admission.NMAX_RATIO_MIN:.0%} of N_max_pinned {n_pinned})")
    levels = [await admission_level(args, target, n_fresh, corpus, rt, shape, jsonl)]
    target.search = warm_search(args, levels[0])
    _enter(target, admission.WARM, f"N_max searched again from {target.search.start}")
    levels += await search_levels(args, [target], corpus, rt, shape, jsonl)
    overload = admission.overload_shape(shape, args.audio_within_s)
    for k in admission.OVERLOADS:
        _enter(target, admission.overload_phase(k), f"{k} x N_max_pinned (window {overload.window_s:g} s)")
        levels.append(await admission_level(args, target, k * n_pinned, corpus, rt, overload, jsonl, fail_early=False))
    return levels


def _enter(target: Target, phase: str, what: str) -> None:
    target.phase = phase
    print(f"[{target.name}] {phase}: {what}", file=sys.stderr, flush=True)


async def admission_level(args: argparse.Namespace, target: Target, n: int, corpus: Corpus, rt: Targets,
                          shape: LoadShape, jsonl: Any, fail_early: bool = True) -> dict:
    """One level outside a search, with what an overload level is judged by."""
    record, level_run = await run_level(args, target, [target], n, 1, corpus, rt, shape, jsonl, fail_early)
    record.update(admission.overload_figures(level_run, rt, args.audio_within_s))
    print(admission.figures_line(record), flush=True)
    return record


# -- main ---------------------------------------------------------------------------------------


def output_prefix(args: argparse.Namespace, targets: Sequence[Target], machine: dict) -> Path:
    if args.out_prefix:
        return args.out_prefix
    name = f"concurrency-{report.device_slug(machine)}"
    if args.admission:
        name += "-admission"
    elif len(targets) == 2:
        name += f"-{targets[0].name}-vs-{targets[1].name}"
    return provenance.REPO_ROOT / "benchmarks" / "results" / (name + ("-quick" if args.quick else ""))


def searched(levels: Sequence[dict]) -> list[dict]:
    """The levels of the searches (--admission's fresh and overload levels are its own figures)."""
    return [r for r in levels if r.get("phase") in (None, admission.PINNED, admission.WARM)]


def summarize(targets: Sequence[Target], rt: Targets) -> list[dict]:
    out = []
    for t in targets:
        per_gpu = round(t.search.n_max / t.gpus, 3) if t.gpus else None
        out.append({"name": t.name, "n_max": t.search.n_max, "gpus": t.gpus, "n_max_per_gpu": per_gpu,
                    **t.search.summary(), "n_max_within_gap_slo": n_max_within_gap_slos(searched(t.levels), rt)})
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind like Ctrl-C: the stacks get stopped
    t_start = time.perf_counter()
    corpus = load_corpus(args.corpus, tuple(k.strip() for k in args.kinds.split(",")), args.seed)
    rt = Targets(ttfa_s=args.ttfa_target_s, buffer_s=args.buffer_s, pace=args.pace,
                 success_share=args.success_share, realtime_share=args.realtime_share)
    shape = LoadShape(stagger_s=args.stagger_s, warmup_s=args.warmup_s, window_s=args.window_s,
                      max_level_s=args.max_level_s, read_timeout_s=args.read_timeout_s, seed=args.seed)
    machine = provenance.machine()
    log_dir = Path(tempfile.mkdtemp(prefix="concurrency-bench-"))
    targets = admission_targets(args, log_dir) if args.admission else build_targets(args, log_dir)
    prefix = output_prefix(args, targets, machine)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    load_start = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {"benchmark": "concurrency", "title": _title(args, targets, machine)}
    failed, poisson = False, None
    try:
        if not args.admission:  # its stacks start one after the other
            start_stacks(targets)
        with open(f"{prefix}.jsonl", "w") as jsonl:
            if args.admission:
                levels = run_admission(args, targets, corpus, rt, shape, jsonl)
            else:
                levels = asyncio.run(run_search(args, targets, corpus, rt, shape, jsonl))
            if args.poisson_check:
                poisson = asyncio.run(poisson_checks(args, targets, corpus, rt, shape, jsonl))
    except BaseException:
        failed = True
        for t in targets:
            if t.stack:
                print(f"--- {t.name} logs ({log_dir}) ---\n{t.stack.tail()}", file=sys.stderr)
        raise
    finally:
        for t in targets:
            if t.stack:
                t.stack.stop()
        if not (args.keep_logs or failed):
            shutil.rmtree(log_dir, ignore_errors=True)
    for t in targets:
        if t.stack and t.gpus is None:
            t.gpus = t.stack.gpus()
    headroom = None
    if not args.no_headroom:
        heaviest = max(levels, key=lambda r: r["chunks_per_s"], default=None)
        streams = args.headroom_streams or max(32, 4 * max((r["n"] for r in levels), default=1))
        headroom = asyncio.run(headroom_check(streams, args.headroom_seconds, rt, corpus, heaviest))
        print(f"client headroom: {'PASS' if headroom['passed'] else 'FAIL'} with {streams} streams at real time: "
              f"TTFA overhead p95 {headroom['ttfa_overhead_s_p95']} s, buffer needed p99 "
              f"{headroom['required_buffer_s']['p99']} s, loop lag p99 {headroom['client']['loop_lag_ms']['p99']} ms; "
              f"load vs heaviest level {headroom['load_vs_heaviest_level']}", flush=True)
    summary = summarize(targets, rt)
    # --admission: its searches compared as two targets; its fresh and overload levels are its own figures
    search_levels_run = searched(levels)
    if args.admission:  # first in the JSON, after the title: what the mode is for
        by_name = {r["name"]: r for r in summary}
        result["admission"] = admission.outcome(levels, by_name["pinned"], by_name["unconfigured"],
                                                args.audio_within_s)
    result.update({
        "provenance": provenance.record(report.PACKAGES, argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
        "load_shape": asdict(shape), "targets": asdict(rt), "corpus": corpus.describe(),
        "endpoints": [_describe_target(t) for t in targets],
        "results": summary,
        "comparison": report.comparison(summary, search_levels_run) if len(targets) == 2 else None,
        "poisson_check": poisson,
        "client_headroom": headroom,
        "contention": {"load_average_start": load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()],
                       "other_processes_cores_max": max((r["cores"]["other_processes"] for r in levels), default=None)},
        "definitions": report.DEFINITIONS,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "levels": levels,
    })
    plots = report.plots({**result, "levels": search_levels_run}, prefix)
    if args.admission:
        plots.append(admission.plot(levels, result["admission"]["n_max_pinned"], f"{prefix}-admission.png",
                                    result["title"]))
    result["files"] = {"jsonl": f"{prefix.name}.jsonl", "plots": [Path(p).name for p in plots]}
    # --admission's levels hold sampled time series: a line each, not a line a value
    text = report.compact_json(result) if args.admission else json.dumps(result, indent=1) + "\n"
    Path(f"{prefix}.json").write_text(text)
    print_summary(result, prefix)
    return result


def start_stacks(targets: Sequence[Target]) -> None:
    """Start every local stack at once, then wait for each (their engines load side by side)."""
    stacks = [t.stack for t in targets if t.stack]
    for stack in stacks:
        print(f"[{stack.name}] starting: {' '.join(stack.argv[1:])}", file=sys.stderr, flush=True)
        stack.start()
    for stack in stacks:
        print(f"[{stack.name}] ready after {stack.wait_ready():.0f} s at {stack.url}", file=sys.stderr, flush=True)


def print_summary(result: dict, prefix: Path) -> None:
    for r in result["results"]:
        per_gpu = f", {r['n_max_per_gpu']} per GPU ({r['gpus']} GPUs)" if r["n_max_per_gpu"] is not None else \
            " (no GPU: streams per machine)"
        note = " (every level up to --max-n passed: a lower bound)" if r["censored_at_max_n"] else \
            "" if r["confirmed"] else " (boundary not confirmed)"
        slo = ", ".join(f"{n} with no gap over {t}" for t, n in r["n_max_within_gap_slo"].items())
        print(f"[{r['name']}] N_max = {r['n_max']}{per_gpu}{note}; levels run {r['levels_run']}; "
              f"under the continuity SLOs (levels run): {slo}")
    if result["comparison"]:
        print(report.comparison_text(result["comparison"]))
    if "admission" in result:
        print(admission.summary_text(result["admission"]))
    print(f"wrote {prefix}.json, .jsonl and {len(result['files']['plots'])} plots ({result['wall_s']:.0f} s)")


def _describe_target(t: Target) -> dict:
    out = {"name": t.name, "url": t.endpoint.url, "gpus": t.gpus, "launched": t.stack is not None}
    if t.stack:
        out.update({"megapod_up": t.stack.command, "topology": t.stack.topology,
                    "startup_s": round(t.stack.startup_s or 0, 1)})
    return out


def _title(args: argparse.Namespace, targets: Sequence[Target], machine: dict) -> str:
    where = machine["gpus"][0] if machine["gpus"] else f"CPU, {machine['cores_usable']} cores"
    pace = f", pace {args.pace:g}x" if args.pace != 1 else ""
    mode = "admission limit: " if args.admission else ""
    return f"{mode}{' vs '.join(t.name for t in targets)} ({where}{pace})"


if __name__ == "__main__":
    main()
