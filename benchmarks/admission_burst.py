"""A burst at a limit still in its slow start: `megapod up` unconfigured as `concurrency.py --admission` starts it,
one level at 90 % of a given N_max_pinned (the fresh level), then at once 2x and 3x of it, with no search between.

`concurrency.py --admission` searches N_max on the warm stack before its overload levels, so its limit has been cut
and is growing one stream at a time when the overload comes. Here the overload meets the limit the fresh level left:
in its slow start unless a listener fell behind, which is where it doubled 32 -> 64 on the engine's pace while the
streams the burst had just admitted waited for their first audio (issue 43). Each level is judged as
`--admission`'s overload levels are: admitted streams that ran past the buffer, codec failovers, clients with audio in
time, with the worker's limit sampled beside it. The N_max to scale by comes from a `concurrency.py --admission` run
(its `n_max_pinned`) on the same machine.

    .venv/bin/python benchmarks/admission_burst.py --n-pinned 22          # writes results/admission-burst-cpu.json

`--pinned` runs the same levels on `--admission`'s pinned stack (fresh too): whether a fresh level's trouble is the
limit's or the fresh stack's own; `--fresh-only` stops after the fresh level.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import concurrency, provenance
from benchmarks.concurrency_bench import admission, report
from benchmarks.concurrency_bench.admission import brief

OVERLOADS = (2, 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-pinned", type=int, required=True, help="N_max with the limit pinned, from concurrency.py")
    p.add_argument("--out", type=Path, default=provenance.REPO_ROOT / "benchmarks/results/admission-burst-cpu.json")
    p.add_argument("--keep-logs", action="store_true", help="keep the stack's logs (their folder is printed)")
    p.add_argument("--pinned", action="store_true",
                   help="the same levels on --admission's pinned stack instead: the reference for a fresh stack")
    p.add_argument("--fresh-only", action="store_true", help="the fresh level alone, no overload after it")
    return p.parse_args(argv)


async def levels(args, bench: argparse.Namespace, target, corpus, rt, shape, jsonl) -> list[dict]:
    await concurrency.warm_up_targets(bench, [target], corpus)
    concurrency._enter(target, admission.FRESH, f"{admission.fresh_n(args.n_pinned)} streams at once")
    out = [await concurrency.admission_level(bench, target, admission.fresh_n(args.n_pinned), corpus, rt, shape, jsonl)]
    overload = admission.overload_shape(shape, bench.audio_within_s)
    for k in () if args.fresh_only else OVERLOADS:
        concurrency._enter(target, admission.overload_phase(k), f"{k} x {args.n_pinned}, right after")
        out.append(await concurrency.admission_level(bench, target, k * args.n_pinned, corpus, rt, overload, jsonl,
                                                     fail_early=False))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bench = concurrency.parse_args(["--quick", "--admission"])  # --admission's stack, load shape and targets
    corpus = concurrency.load_corpus(bench.corpus, tuple(k.strip() for k in bench.kinds.split(",")), bench.seed)
    rt = concurrency.Targets(ttfa_s=bench.ttfa_target_s, buffer_s=bench.buffer_s, pace=bench.pace,
                             success_share=bench.success_share, realtime_share=bench.realtime_share)
    shape = concurrency.LoadShape(stagger_s=bench.stagger_s, warmup_s=bench.warmup_s, window_s=bench.window_s,
                                  max_level_s=bench.max_level_s, read_timeout_s=bench.read_timeout_s, seed=bench.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="admission-burst-"))
    target = concurrency.admission_targets(bench, log_dir)[1 if args.pinned else 0]  # [unconfigured, pinned]
    started = time.perf_counter()
    concurrency.start_stacks([target])
    try:
        with open(args.out.with_suffix(".jsonl"), "w") as jsonl:
            run = asyncio.run(levels(args, bench, target, corpus, rt, shape, jsonl))
    finally:
        target.stack.stop()
        print(f"the stack's logs: {log_dir}" if args.keep_logs else "", file=sys.stderr)
    result = {"benchmark": "admission_burst", "n_pinned": args.n_pinned, "stack": target.name,
              "provenance": provenance.record(report.PACKAGES, argv),
              "megapod_args": target.stack.argv[4:], "wall_s": round(time.perf_counter() - started, 1),
              "levels": {r["phase"]: brief(r) for r in run},
              "admitted_over_buffer": sum(r["admitted_over_buffer"] for r in run),
              "gauges": {r["phase"]: r.get("gauges") for r in run}}
    provenance.write_result(args.out, result)
    for phase, r in result["levels"].items():
        print(f"{phase}: N={r['n']} admitted {r['admitted_requests']}, over the buffer {r['admitted_over_buffer']}, "
              f"refused {r['refused_requests']}, clients with audio in time {r['clients_audio_within_share']}, "
              f"limit {r['limit_first']} -> {r['limit_last']} (max {r['limit_max']})")
    if not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
