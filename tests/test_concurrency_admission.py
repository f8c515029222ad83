"""concurrency.py --admission's figures (issue 43), on synthetic requests, level records and metrics pages.

Audio is 24 kHz s16le mono: 48,000 bytes per audio second. Every expected value is worked out by hand
in the comment beside it. No stack is started.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from benchmarks.concurrency import parse_args, warm_search
from benchmarks.concurrency_bench import admission
from benchmarks.concurrency_bench.load import LevelRun, LoadShape, Request
from benchmarks.concurrency_bench.metrics import Targets
from benchmarks.concurrency_bench.report import compact_json
from benchmarks.concurrency_bench.stack import gauges

SECOND = 48_000  # bytes of one audio second


def _run(requests: list[Request], n: int, wall_s: float = 20.0) -> LevelRun:
    return LevelRun("unconfigured", n, 1, "closed", 0.0, 0.0, 1.0, "complete", wall_s, requests, {}, 0.0)


def _ok(stream: int, seq: int, sent: float, chunks: list[tuple[float, int]]) -> Request:
    return Request(stream, seq, "s001", True, sent, chunks, 200, chunks[-1][0], True)


def _refused(stream: int, seq: int, sent: float, status: int = 429) -> Request:
    return Request(stream, seq, "s001", True, sent, [], status, sent + 0.01, False, f"HTTP {status}: busy")


def test_clients_with_audio_within_count_each_client_once_from_its_first_request():
    run = _run([
        _ok(0, 0, 0.0, [(2.0, SECOND), (3.0, SECOND)]),  # client 0: audio 2 s after its first request
        _ok(0, 1, 3.5, [(4.0, SECOND)]),  # its later requests do not count twice
        _refused(1, 0, 0.1),  # client 1: refused at 0.1, admitted on its retry, audio at 12.0: 11.9 s
        _ok(1, 1, 1.0, [(12.0, SECOND)]),
        _refused(2, 0, 0.2, 503),  # client 2: refused at 0.2, audio at 10.2 on the retry: exactly 10 s
        _ok(2, 1, 5.0, [(10.2, SECOND)]),
        # client 3 never sent a request (the level ended before its start): without audio
    ], n=4)
    assert admission.clients_audio_within_share(run, 10.0) == 0.5  # clients 0 and 2 of 4
    assert admission.clients_audio_within_share(run, 12.0) == 0.75  # client 1 too
    assert admission.clients_audio_within_share(_run([], n=0), 10.0) is None


def test_admitted_over_buffer_counts_only_admitted_streams_that_stalled():
    targets = Targets(ttfa_s=5.0, buffer_s=0.3)
    steady = _ok(0, 0, 0.0, [(0.5 + 0.1 * k, SECOND // 10) for k in range(10)])  # exactly real time: never dry
    # 1 s of audio at 1.0, 0.5 s at 1.5, 1 s at 3.0: needs 0.5 s of buffer, over 0.3
    stalling = _ok(1, 0, 0.0, [(1.0, SECOND), (1.5, SECOND // 2), (3.0, SECOND)])
    # cut open at the level's end: 1 s at 10.0, then 1 s at 12.0 (0.7 s after playback reached it): stalled
    starved = Request(2, 0, "s001", True, 9.0, [(10.0, SECOND), (12.0, SECOND)], 200, cut=True)
    # cut open too, silent since its second ran out at 11.3: judged on its chunks, which kept up
    playing = Request(3, 0, "s001", True, 9.0, [(10.0, SECOND)], 200, cut=True)
    waiting = Request(4, 0, "s001", True, 19.0, [], None, cut=True)  # no answer yet: not admitted
    run = _run([steady, stalling, starved, playing, waiting, _refused(5, 0, 1.0), _refused(5, 1, 2.0, 503)], n=6)
    assert admission.admitted_over_buffer(run, targets) == (4, 2)
    figures = admission.overload_figures(run, targets, 10.0)
    assert figures["admitted_requests"] == 4 and figures["admitted_over_buffer"] == 2
    assert figures["refused_requests"] == 2
    assert figures["statuses"] == {"200": 4, "None": 1, "429": 1, "503": 1}
    assert figures["clients"] == 6 and figures["clients_audio_within_s"] == 10.0
    # a listener at pace 0.5: the stalling stream's 1.5 s last 3 s (needed at 4.0, came at 3.0), and the cut
    # one's first second lasts 2 s (its second needed at 12.3, came at 12.0): neither stalls
    assert admission.admitted_over_buffer(run, Targets(ttfa_s=5.0, buffer_s=0.3, pace=0.5)) == (4, 0)


def test_an_overload_level_stays_open_until_every_client_had_its_time():
    shape = LoadShape(stagger_s=2.0, warmup_s=0.0, window_s=0.0, max_level_s=150.0)
    over = admission.overload_shape(shape, 100.0)
    # the last client starts at 2 s: the window must reach 102 s; the time limit moves out as much
    assert over.window_s == 102.0 and over.max_level_s == 252.0 and over.stagger_s == 2.0
    assert admission.overload_shape(LoadShape(window_s=60.0, stagger_s=3.0), 10.0).window_s == 60.0


# -- the sampler ---------------------------------------------------------------------------------

PAGE = """# HELP megapod_worker_capacity_streams Streams this worker admits at once now
# TYPE megapod_worker_capacity_streams gauge
megapod_worker_capacity_streams 4.0
# TYPE orpheus_active_streams gauge
orpheus_active_streams 3.0
# TYPE megapod_worker_decoding_streams gauge
megapod_worker_decoding_streams 2.5
# TYPE orpheus_codec_failovers counter
orpheus_codec_failovers_total {failovers}
# TYPE orpheus_codec_owed_audio_seconds counter
orpheus_codec_owed_audio_seconds_total {owed_audio}
# TYPE orpheus_codec_owed_wait_seconds counter
orpheus_codec_owed_wait_seconds_total {owed_wait}
"""


def page(failovers: float, owed_audio: float = 0.0, owed_wait: float = 0.0) -> str:
    return PAGE.format(failovers=failovers, owed_audio=owed_audio, owed_wait=owed_wait)


def test_metrics_page_parsed_once_for_every_name():
    values = gauges(page(3.0), [*admission.GAUGES.values(), admission.FAILOVERS])
    assert values["megapod_worker_capacity_streams"] == 4.0 and values["orpheus_active_streams"] == 3.0
    assert values[admission.FAILOVERS] == 3.0  # a counter's sample: its name with _total
    assert math.isnan(values["megapod_worker_queued_streams"])  # an older worker: absent
    assert all(math.isnan(v) for v in gauges("<html>502</html>", ["orpheus_active_streams"]).values())


def _reader(text: dict[str, str]):
    async def read(*names: str) -> dict[str, float]:  # LocalStack.worker_metrics over one worker
        return gauges(text["text"], names)
    return read


def test_sampler_records_the_gauges_beside_a_level_and_the_failovers_over_it():
    text = {"text": page(3.0, owed_audio=10.0, owed_wait=20.0)}

    async def level() -> LevelRun:
        t0 = time.perf_counter()
        await asyncio.sleep(0.3)
        text["text"] = page(5.0, owed_audio=16.0, owed_wait=80.0)  # two failovers; 6 s of owed audio in 60 s waited
        await asyncio.sleep(0.05)
        return LevelRun("unconfigured", 1, 1, "closed", t0, 0.0, 0.0, "complete", time.perf_counter() - t0, [], {}, 0.0)

    run, figures = asyncio.run(admission.sampled(_reader(text), level(), period_s=0.05))
    assert run.endpoint == "unconfigured"  # the level's own run, handed back
    g = figures["gauges"]
    assert figures["codec_failovers"] == 2 and figures["codec_owed_pace"] == 0.1
    assert g["codec_owed_audio_s"][0] == 10 and g["codec_owed_wait_s"][-1] == 80
    assert g["period_s"] == 0.05 and len(g["t"]) >= 4  # 0.35 s at 0.05 s: about 7 samples
    assert g["t"] == sorted(g["t"]) and -0.1 <= g["t"][0] <= 0.1  # seconds from the level's start
    assert set(g["limit"]) == {4} and set(g["admitted"]) == {3} and set(g["decoding"]) == {2.5}
    assert set(g["queued"]) == {None}  # missing gauge: None, not nan
    assert all(len(g[k]) == len(g["t"]) for k in admission.GAUGES)
    json.dumps(figures, allow_nan=False)  # the record stays valid JSON


def test_sampler_without_the_failover_counter_says_none():
    text = {"text": "# TYPE orpheus_active_streams gauge\norpheus_active_streams 1.0\n"}

    async def level() -> LevelRun:
        return LevelRun("x", 1, 1, "closed", time.perf_counter(), 0.0, 0.0, "complete", 0.0, [], {}, 0.0)

    _, figures = asyncio.run(admission.sampled(_reader(text), level(), period_s=0.05))
    assert figures["codec_failovers"] is None and figures["gauges"]["limit"] == [None] * len(figures["gauges"]["t"])
    assert figures["codec_owed_pace"] is None


# -- outcome and acceptance ----------------------------------------------------------------------


def _record(phase: str, n: int, passed: bool, **figures) -> dict:
    base = {"n": n, "run": 1, "passed": passed, "reasons": [] if passed else ["refused"], "ended_by": "complete",
            "wall_s": 30.0, "success_share": 1.0, "realtime_share": 1.0, "ttfa_s": {"p95": 1.0},
            "required_buffer_s": {"p95": 0.1}, "phase": phase, "admitted_requests": 10, "admitted_over_buffer": 0,
            "refused_requests": 0, "clients": n, "clients_audio_within_s": 100.0, "clients_audio_within_share": 1.0,
            "codec_failovers": 0,
            "gauges": {"period_s": 0.5, "t": [0.0, 10.0, 20.0], "limit": [4, 6, 7], "admitted": [4, 6, 7],
                       "decoding": [4, 6, 7], "queued": [3, 1, None]}}
    return {**base, **figures}


def _levels(fresh_passed=True, over_2x=None, over_3x=None) -> list[dict]:
    return [_record(admission.PINNED, 4, True), _record(admission.PINNED, 8, False),
            _record(admission.FRESH, 7, fresh_passed),
            _record(admission.WARM, 4, True), _record(admission.WARM, 8, False),
            _record("overload 2x", 14, False, **{"refused_requests": 9, "clients_audio_within_share": 0.93,
                                                  **(over_2x or {})}),
            _record("overload 3x", 21, False, **{"refused_requests": 30, "clients_audio_within_share": 0.6,
                                                  **(over_3x or {})})]


def _outcome(levels: list[dict], n_pinned: int = 7, n_warm: int = 7) -> dict:
    return admission.outcome(levels, {"name": "pinned", "n_max": n_pinned}, {"name": "unconfigured", "n_max": n_warm},
                             100.0)


def test_acceptance_holds_when_every_criterion_does():
    out = _outcome(_levels())
    assert out["acceptance"]["passed"], out["acceptance"]
    assert out["ratios_unconfigured_over_pinned"] == {"fresh": 1.0, "warm": 1.0}
    assert out["n_max_pinned"] == 7 and out["n_max_unconfigured_warm"] == 7
    assert set(out["acceptance"]["criteria"]) == {
        "fresh_n_max_ratio", "warm_n_max_ratio", "2x_no_admitted_over_buffer", "2x_no_codec_failover",
        "3x_no_admitted_over_buffer", "3x_no_codec_failover", "2x_clients_audio_within"}
    assert out["fresh"]["n"] == 7 and (out["fresh"]["limit_first"], out["fresh"]["limit_last"]) == (4, 7)
    assert out["overload"]["overload 3x"]["refused_requests"] == 30
    assert "gauges" not in out["fresh"]  # the series stay in the level records
    assert "acceptance: PASS" in admission.summary_text(out)


@pytest.mark.parametrize(("levels", "n_warm", "failed"), [
    (_levels(fresh_passed=False), 7, {"fresh_n_max_ratio"}),  # the fresh level at N_max_pinned failed
    (_levels(), 6, {"warm_n_max_ratio"}),  # 6 / 7 = 0.857 < 0.9
    (_levels(over_3x={"admitted_over_buffer": 1}), 7, {"3x_no_admitted_over_buffer"}),
    (_levels(over_2x={"codec_failovers": 2}), 7, {"2x_no_codec_failover"}),
    (_levels(over_2x={"codec_failovers": None}), 7, {"2x_no_codec_failover"}),  # unknown is not zero
    (_levels(over_2x={"clients_audio_within_share": 0.89}), 7, {"2x_clients_audio_within"}),
])
def test_acceptance_names_the_criterion_missed(levels, n_warm, failed):
    out = _outcome(levels, n_warm=n_warm)
    criteria = out["acceptance"]["criteria"]
    assert not out["acceptance"]["passed"]
    assert {k for k, c in criteria.items() if not c["passed"]} == failed
    assert "acceptance: FAIL" in admission.summary_text(out)


def test_the_searches_levels_that_passed_with_admitted_streams_over_the_buffer_are_named():
    """A search level is judged on the streams sent while its window was open; its clients' later streams ran past
    the buffer at the edge (issue 43, run 44: the pinned level of 50 passed with 2 of them), and the outcome says so."""
    levels = _levels()
    levels[0]["admitted_over_buffer"] = 2  # the pinned 4, passed
    levels[1]["admitted_over_buffer"] = 3  # the pinned 8, failed: its failure says it already
    out = _outcome(levels)
    assert out["passed_with_admitted_over_buffer"] == {
        admission.PINNED: [{"n": 4, "run": 1, "admitted_requests": levels[0]["admitted_requests"], "admitted_over_buffer": 2}],
        admission.WARM: []}
    assert "pinned search: passed with admitted streams over the buffer (after its window): N=4 2/10" in admission.summary_text(out)


def test_warm_ratio_at_ninety_percent_passes_and_no_pinned_capacity_fails_both():
    criteria = _outcome(_levels(), n_pinned=10, n_warm=9)["acceptance"]["criteria"]
    assert criteria["warm_n_max_ratio"]["ratio"] == 0.9 and criteria["warm_n_max_ratio"]["passed"]
    out = _outcome(_levels(), n_pinned=0, n_warm=3)  # nothing passed pinned: nothing to compare with
    assert out["ratios_unconfigured_over_pinned"] == {"fresh": None, "warm": None}
    assert not out["acceptance"]["criteria"]["fresh_n_max_ratio"]["passed"]
    assert not out["acceptance"]["criteria"]["warm_n_max_ratio"]["passed"]


def test_plot_and_compact_json_are_written(tmp_path):
    levels = _levels()
    levels[3]["gauges"] = None  # a level without samples still plots (as a gap)
    path = admission.plot(levels, 7, str(tmp_path / "run-admission.png"), "admission limit: test")
    assert (tmp_path / "run-admission.png").stat().st_size > 10_000
    assert path.endswith("run-admission.png")
    text = compact_json({"levels": levels, "admission": _outcome(_levels())})
    assert json.loads(text) == {"levels": levels, "admission": _outcome(_levels())}
    assert '"limit": [4, 6, 7]' in text  # a series on one line


def test_admission_flags():
    args = parse_args(["--admission", "--quick"])
    assert args.megapod_args == "--enforce-eager true"  # megapod up's defaults: two codec replicas, also --quick
    assert args.audio_within_s == pytest.approx(100.0)  # 10 s at the --quick listener's 0.1x
    assert args.policy == ["streaming"] and args.max_n == 16 and args.max_levels == 16  # --quick alone: 12
    assert parse_args(["--quick"]).max_levels == 12 and parse_args(["--admission"]).max_levels == 40
    assert parse_args(["--admission", "--megapod-args", "--replicas 3", "--audio-within-s", "5"]).megapod_args == \
        "--replicas 3"
    assert parse_args(["--quick"]).megapod_args == "--replicas 1 --enforce-eager true"  # unchanged
    for wrong in (["--admission", "--url", "http://x"], ["--admission", "--policy", "reference"],
                  ["--admission", "--poisson-check"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)
    with pytest.raises(SystemExit) as done:
        parse_args(["--admission", "--help"])
    assert done.value.code == 0


def test_the_fresh_level_is_the_fewest_streams_that_are_90_percent_of_the_pinned_n_max():
    assert [admission.fresh_n(n) for n in (1, 6, 10, 14, 20)] == [1, 6, 9, 13, 18]


def test_the_warm_search_starts_where_the_fresh_level_passed():
    """From the fresh level's N when it passed (then doubling, bisecting): run 28's search from 1 spent 6 of --quick's
    12 levels reaching 32 and had none left for 17-31 when 32 failed its repeat. From 1 when the fresh level failed."""
    args = parse_args(["--admission", "--quick", "--max-n", "48"])
    search = warm_search(args, {"n": 29, "passed": True})
    verdicts = {29: True, 48: False, 38: False, 33: False, 31: True, 32: False}
    while (n := search.next_level()) is not None:
        search.record(n, verdicts[n])
    assert search.order == [29, 48, 38, 33, 31, 32, 31, 32] and search.n_max == 31 and search.confirmed
    assert warm_search(args, {"n": 29, "passed": False}).next_level() == 1
