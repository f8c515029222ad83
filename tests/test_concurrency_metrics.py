"""The concurrency benchmark's metrics, verdicts and search, on synthetic timelines with known answers.

Audio is 24 kHz s16le mono: 48,000 bytes per audio second, so 4,800 bytes = 0.1 s. Every
expected value is worked out by hand in the comment beside it. The last two tests drive the
real load client against the benchmark's trivial endpoint (a process of its own) for a few seconds.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import pytest

from benchmarks.concurrency_bench import metrics
from benchmarks.concurrency_bench.corpus import load_corpus
from benchmarks.concurrency_bench.levels import level_record, n_max_within_gap_slos, throughput
from benchmarks.concurrency_bench.load import Endpoint, Level, LevelRun, LoadShape
from benchmarks.concurrency_bench.metrics import Counts, Targets, Timeline
from benchmarks.concurrency_bench.search import Search
from megapod.launcher import Child, free_ports

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

SECOND = 48_000  # bytes of one audio second

# Never stalls: first audio at 0.5 s, then one 0.1 s chunk every 0.1 s (exactly real time), 10 chunks.
STEADY = Timeline(0.0, tuple((0.5 + 0.1 * k, SECOND // 10) for k in range(10)), ended_s=1.4, completed=True)
# Stalls: 1 s of audio at 1.0, 0.5 s at 1.5, 1 s at 3.0. Playback from 1.0 with no buffer has played
# 1.5 s by 2.5, but the third chunk comes at 3.0: it needed 3.0 - 1.0 - 1.5 = 0.5 s of buffer.
STALLING = Timeline(0.0, ((1.0, SECOND), (1.5, SECOND // 2), (3.0, SECOND)), ended_s=3.0, completed=True)
# Ends early: 2 s of audio, then the connection breaks (the server died mid-stream).
CUT = Timeline(0.0, ((0.2, SECOND), (0.4, SECOND)), ended_s=0.5, completed=False, error="RemoteProtocolError: cut")


def test_steady_stream_never_runs_dry():
    assert metrics.time_to_first_audio(STEADY) == pytest.approx(0.5)
    # chunk k: arrival - first - audio before = (0.5 + 0.1k) - 0.5 - 0.1k = 0 for every k
    assert metrics.required_buffer_s(STEADY.chunks) == pytest.approx(0.0, abs=1e-12)
    assert metrics.real_time(STEADY, buffer_s=0.0)
    assert metrics.stalls(STEADY.chunks, buffer_s=0.0) == (0, 0.0)
    assert metrics.gaps_s(STEADY.chunks) == pytest.approx([0.1] * 9)
    assert STEADY.audio_s == pytest.approx(1.0)  # 10 x 4,800 bytes
    assert metrics.real_time_factor(STEADY) == pytest.approx(1.4)  # 1.4 s wall for 1.0 s of audio
    assert metrics.succeeded(STEADY) and not metrics.truncated(STEADY)


def test_stalling_stream_needs_half_a_second():
    # chunk 0: 0; chunk 1: 1.5 - 1.0 - 1.0 = -0.5; chunk 2: 3.0 - 1.0 - 1.5 = 0.5 -> 0.5
    assert metrics.required_buffer_s(STALLING.chunks) == pytest.approx(0.5)
    assert not metrics.real_time(STALLING, buffer_s=0.3)
    assert metrics.real_time(STALLING, buffer_s=0.5)
    assert metrics.succeeded(STALLING)  # it ran dry, but it delivered everything
    # B = 0.3: playback starts 1.3, reaches chunk 1 at 2.3 (arrived 1.5), chunk 2 at 2.8 -> waits 0.2 s
    count, waited = metrics.stalls(STALLING.chunks, buffer_s=0.3)
    assert count == 1 and waited == pytest.approx(0.2)
    # B = 0: the wait is the whole required buffer, 0.5 s
    assert metrics.stalls(STALLING.chunks, buffer_s=0.0)[1] == pytest.approx(0.5)
    assert metrics.gaps_s(STALLING.chunks) == pytest.approx([0.5, 1.5])
    assert metrics.time_to_first_audio(STALLING) == pytest.approx(1.0)


def test_slower_pace_turns_a_stall_into_real_time():
    # Played at half speed, 1.5 s of audio lasts 3 s: chunk 2 is needed at 1.0 + 3.0 = 4.0, arrives 3.0.
    assert metrics.required_buffer_s(STALLING.chunks, pace=0.5) == pytest.approx(0.0)
    assert metrics.real_time(STALLING, buffer_s=0.0, pace=0.5)
    # Played at double speed it needs more: chunk 1: 1.5 - 1.0 - 1.0/2 = 0; chunk 2: 3.0 - 1.0 - 1.5/2 = 1.25
    assert metrics.required_buffer_s(STALLING.chunks, pace=2.0) == pytest.approx(1.25)


def test_the_worst_gap_is_the_longest_wait_from_the_first_audio_with_no_buffer():
    # STALLING with no buffer: plays 1.0-2.0, the 0.5 s chunk (1.5) 2.0-2.5, then waits for 3.0: 0.5 s
    assert metrics.worst_gap_s(STALLING.chunks) == pytest.approx(0.5)
    assert metrics.worst_gap_s(STEADY.chunks) == pytest.approx(0.0)
    # at 0.1x everything is heard ten times slower: 1 s of audio lasts 10 s, so no wait at all
    assert metrics.worst_gap_s(STALLING.chunks, pace=0.1) == pytest.approx(0.0)
    # ...and a wait on the clock counts x pace: 0.1 s chunks every 2 s at 0.1x play 1 s each: 1 s waits = 0.1 s
    slow = tuple((2.0 * k, SECOND // 10) for k in range(4))
    assert metrics.worst_gap_s(slow, pace=0.1) == pytest.approx(0.1)


def test_n_max_within_a_gap_slo_is_read_off_the_levels_run():
    def level(n, continuous_200ms, success=1.0, ttfa=1.0):
        return {"n": n, "continuity_share": {"100ms": 0.0, "200ms": continuous_200ms}, "success_share": success,
                "ttfa_within_target_share": ttfa}

    levels = [level(1, 1.0), level(2, 1.0), level(4, 0.5), level(3, 1.0), level(3, 0.98), level(8, 1.0)]
    # 3 failed on its repeat, and 4 failed: 2; the 100 ms SLO no level met
    assert n_max_within_gap_slos(levels, Targets()) == {"100ms": 0, "200ms": 2}
    assert n_max_within_gap_slos([level(1, 1.0, success=0.5)], Targets()) == {"100ms": 0, "200ms": 0}


def test_stream_cut_mid_audio_is_truncated_and_failed():
    assert metrics.truncated(CUT)
    assert not metrics.succeeded(CUT)
    # It never ran dry while it lasted (0.4 - 0.2 - 1.0 < 0), but a failed stream is not real time.
    assert metrics.required_buffer_s(CUT.chunks) == pytest.approx(0.0)
    assert not metrics.real_time(CUT, buffer_s=10.0)
    figures = metrics.stream_figures(CUT, Targets(buffer_s=10.0))
    assert figures["truncated"] and not figures["ok"] and not figures["real_time"]
    assert figures["audio_s"] == pytest.approx(2.0)


def test_truncation_is_a_partial_sample_not_a_refusal():
    # an odd byte count ends inside a sample
    odd = Timeline(0.0, ((0.1, 4801),), ended_s=1.0, completed=True)
    assert metrics.truncated(odd)
    # refused (HTTP 429): no audio at all is a failure, not a truncation
    refused = Timeline(0.0, (), ended_s=0.01, completed=False, error="HTTP 429: busy")
    assert not metrics.truncated(refused) and not metrics.succeeded(refused)
    assert metrics.time_to_first_audio(refused) is None


def test_open_stream_runs_dry_as_the_clock_passes_its_audio():
    # 1 s of audio arrived at 1.0; with B = 0.3 playback reaches its end at 1.0 + 0.3 + 1.0 = 2.3
    live = Timeline(0.0, ((1.0, SECOND),))
    assert not metrics.ran_dry(live, 0.3, now=2.2)
    assert metrics.ran_dry(live, 0.3, now=2.4)
    # at pace 0.5 the same second lasts 2 s: dry only after 3.3
    assert not metrics.ran_dry(live, 0.3, pace=0.5, now=3.2)
    assert metrics.ran_dry(live, 0.3, pace=0.5, now=3.4)
    # a stream that has ended is judged on its chunks alone, never on the clock
    assert not metrics.ran_dry(STEADY, 0.0, now=100.0)


def test_first_audible_audio():
    pcm = b"".join(int(x).to_bytes(2, "little", signed=True) for x in (0, 10, -400, 5))
    assert metrics.first_audible_sample(pcm, 328) == 2  # |-400| >= 328; |10| is not
    assert metrics.first_audible_sample(pcm, 500) is None
    tl = Timeline(0.0, ((0.5, 1000), (0.6, 1000)))
    assert metrics.time_to_offset(tl, 1500) == pytest.approx(0.6)  # byte 1500 is in the second chunk
    assert metrics.time_to_offset(tl, 999) == pytest.approx(0.5)
    assert metrics.time_to_offset(tl, 2000) is None  # not arrived


def test_level_verdict_thresholds():
    t = Targets(ttfa_s=0.5, buffer_s=0.3)
    assert metrics.allowed(100, 0.99) == 1  # 99 of 100 must succeed
    assert metrics.allowed(10, 0.99) == 0  # ceil(9.9) = 10: every one of 10
    assert metrics.allowed(20, 0.95) == 1  # p95 over 20 streams: ceil(19) = 19 within target
    assert Counts(100, 1, 1, 0).over(t) == []
    assert len(Counts(100, 2, 2, 0).over(t)) == 2  # both success and real-time shares missed
    assert Counts(20, 0, 0, 1).over(t) == []
    assert len(Counts(20, 0, 0, 2).over(t)) == 1

    ok = [STEADY] * 9
    assert metrics.verdict(ok, Targets(ttfa_s=0.6, buffer_s=0.0)) == []
    # TTFA 0.5 s against a 0.4 s target: all 9 late
    assert metrics.count(ok, Targets(ttfa_s=0.4, buffer_s=0.0)).slow_first_audio == 9
    # one stalling stream among 10 fails the real-time share at B = 0.3, but not at B = 0.5
    assert metrics.verdict([*ok, STALLING], Targets(ttfa_s=2.0, buffer_s=0.3)) != []
    assert metrics.verdict([*ok, STALLING], Targets(ttfa_s=2.0, buffer_s=0.5)) == []
    # a cut stream fails the success share
    reasons = metrics.verdict([*ok, CUT], Targets(ttfa_s=2.0, buffer_s=10.0))
    assert any("failed" in r for r in reasons)
    assert metrics.verdict([], t) == ["no stream was measured"]


def test_live_counts_only_what_is_certain():
    t = Targets(ttfa_s=0.5, buffer_s=0.3)
    waiting = Timeline(0.0)  # sent at 0, nothing yet
    assert metrics.count([waiting], t, now=0.4) == Counts(1, 0, 0, 0)
    assert metrics.count([waiting], t, now=0.6).slow_first_audio == 1  # 0.6 s without audio > 0.5
    assert metrics.count([waiting], t, now=0.6).failed == 0  # still open: not a failure yet


def test_throughput_counts_every_stream_inside_the_span():
    from benchmarks.concurrency_bench.load import LevelRun, Request

    a = Request(0, 0, "s001", True, sent_s=10.0, chunks=[(10.5, SECOND), (11.0, SECOND)], ended_s=12.0,
                completed=True)
    b = Request(1, 0, "s002", False, sent_s=9.0, chunks=[(9.5, SECOND), (11.5, SECOND)], ended_s=13.0,
                completed=True)
    run = LevelRun("x", 2, 1, "closed", 9.0, 0.0, 1.0, "complete", 4.0, [a, b], {}, 0.0)
    rate = throughput(run)
    # span = [10.0, 12.0]: a's two seconds and b's chunk at 11.5 -> 3 audio-s in 2 s; b's 9.5 is outside
    assert rate["span_s"] == pytest.approx(2.0)
    assert rate["audio_s_per_s"] == pytest.approx(1.5)
    assert rate["mean_in_flight"] == pytest.approx(2.0)  # both open the whole span


@pytest.mark.parametrize(("passes", "order", "n_max", "confirmed"), [
    (lambda n, k: n <= 5, [1, 2, 4, 8, 6, 5, 5, 6], 5, True),  # double, bisect, repeat both sides
    (lambda n, k: n <= 5 and not (n == 5 and k == 2), [1, 2, 4, 8, 6, 5, 5, 4], 4, False),  # 5 fails on repeat
    (lambda n, k: False, [1, 1], 0, True),  # not even one stream
    (lambda n, k: True, [1, 2, 4, 8], 8, True),  # censored at max_n
])
def test_search(passes, order, n_max, confirmed):
    s = Search(max_n=8)
    while (n := s.next_level()) is not None:
        s.record(n, passes(n, len(s.runs.get(n, [])) + 1))
    assert s.order == order
    assert s.n_max == n_max
    assert s.confirmed is confirmed


def test_search_stops_at_its_level_budget():
    s = Search(max_n=1024, max_levels=3)
    while (n := s.next_level()) is not None:
        s.record(n, True)
    assert s.order == [1, 2, 4] and s.n_max == 4 and not s.confirmed


def test_idle_wait_reads_the_workers_gauges():
    from benchmarks.concurrency_bench.stack import gauge

    page = ('# HELP orpheus_active_streams Speech streams being served\n# TYPE orpheus_active_streams gauge\n'
            'orpheus_active_streams{worker="0"} 2.0\norpheus_active_streams{worker="1"} 1.0\n'
            '# TYPE orpheus_active_streams_peak gauge\norpheus_active_streams_peak 9.0\n')
    assert gauge(page, "orpheus_active_streams") == 3.0  # labelled samples summed, the longer name not
    assert math.isnan(gauge(page, "orpheus_engine_unfinished_requests"))  # absent: never reads as idle
    assert math.isnan(gauge("<html>502 Bad Gateway</html>", "orpheus_active_streams"))


# -- the load client against the trivial endpoint ---------------------------------------------------


@pytest.fixture(scope="module")
def trivial_endpoint(tmp_path_factory):
    """The benchmark's paced fake endpoint: 1 s of audio per request, served at half real time."""
    port = free_ports(1)[0]
    script = BENCH / "concurrency_bench" / "fake_endpoint.py"
    endpoint = Child("trivial endpoint", [sys.executable, str(script), "--port", str(port), "--ttfa-ms", "50",
                                          "--audio-s", "1", "--pace", "0.5"],
                     tmp_path_factory.mktemp("trivial") / "endpoint.log", f"http://127.0.0.1:{port}/ready")
    endpoint.start().wait_ready(30)
    yield f"http://127.0.0.1:{port}"
    endpoint.stop(timeout_s=10)


def _level(url: str, targets: Targets, fail_early: bool = True) -> tuple[dict, LevelRun]:
    corpus = load_corpus(kinds=("short",))
    shape = LoadShape(stagger_s=0.2, warmup_s=0.0, window_s=0.0, max_level_s=30.0, read_timeout_s=10.0)
    run = asyncio.run(Level(Endpoint("trivial", url), shape, targets, corpus, 3, fail_early=fail_early).run_level())
    return level_record(run, targets, None), run


def test_level_passes_when_streams_keep_up(trivial_endpoint):
    # Served at 0.5x real time (a 85 ms frame every 171 ms): a listener at pace 0.5 never runs dry
    # (the 0.5 s buffer only absorbs scheduling jitter on a loaded test machine).
    record, run = _level(trivial_endpoint, Targets(ttfa_s=1.0, buffer_s=0.5, pace=0.5))
    assert record["passed"], record["reasons"]
    assert record["ended_by"] == "complete" and record["streams_counted"] == 3
    assert record["success_share"] == 1.0 and record["realtime_share"] == 1.0
    assert 0.05 <= record["ttfa_s"]["p50"] < 1.0  # the endpoint waits 50 ms
    assert record["audio_s_per_stream"]["p50"] == pytest.approx(12 * 4096 / SECOND)  # round(1 s / 85.3 ms) = 12 frames
    assert all(r.completed for r in run.counted)


def test_level_fails_early_when_streams_run_dry(trivial_endpoint):
    # The same half-speed audio against a real-time listener with 0.1 s of buffer: each 85 ms frame
    # arrives 171 ms after the last, so playback runs dry within a few frames and the level ends then.
    record, run = _level(trivial_endpoint, Targets(ttfa_s=1.0, buffer_s=0.1, pace=1.0))
    assert not record["passed"]
    assert record["ended_by"] == "failed early"
    assert any("not real time" in r for r in record["reasons"])
    assert record["wall_s"] < 1.5  # a 1 s request takes ~2 s at half speed: it did not wait for the end


def test_level_told_not_to_fail_early_runs_its_course(trivial_endpoint):
    # The same doomed level as above, as --admission's overload levels run: to the end of its counted requests.
    record, run = _level(trivial_endpoint, Targets(ttfa_s=1.0, buffer_s=0.1, pace=1.0), fail_early=False)
    assert not record["passed"] and record["ended_by"] == "complete"
    assert all(r.completed for r in run.counted)  # each 1 s request ran its ~2 s at half speed
    assert record["wall_s"] >= 1.5


def test_the_benchmark_writes_its_json_timelines_and_plots(trivial_endpoint, tmp_path):
    """concurrency.py end to end against a URL (the trivial endpoint at half speed, a listener at pace
    0.5): the search runs its levels, the client-headroom check runs, and every file is written."""
    import json
    import subprocess

    prefix = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(BENCH / "concurrency.py"), "--url", trivial_endpoint, "--name", "trivial", "--gpus", "1",
         "--pace", "0.5", "--ttfa-target-s", "1", "--buffer-s", "0.5", "--kinds", "short", "--max-n", "2",
         "--stagger-s", "0.2", "--warmup-s", "0", "--window-s", "0", "--max-level-s", "30", "--settle-s", "0",
         "--warmup-requests", "1", "--headroom-streams", "4", "--headroom-seconds", "2", "--out-prefix", str(prefix)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert [r["n"] for r in result["levels"]] == [1, 2] and all(r["passed"] for r in result["levels"])
    assert result["results"][0]["n_max"] == 2 and result["client_headroom"]["streams"] == 4
    assert result["provenance"]["versions"]["numpy"] and result["provenance"]["machine"]["cores_usable"] >= 1
    rows = [json.loads(line) for line in prefix.with_suffix(".jsonl").read_text().splitlines()]
    assert {row["n"] for row in rows} == {1, 2} and all(row["chunks"] for row in rows if row["completed"])
    assert sorted(result["files"]["plots"]) == [f"run-{k}.png" for k in ("realtime", "throughput", "ttfa")]
    assert all((tmp_path / name).stat().st_size > 0 for name in result["files"]["plots"])
