"""The voices directory at scale (issue 41, item 3): 10,000 clone voices on a slow filesystem (every stat of the
scan made to take a while, as on NFS or CephFS) change nothing for a live stream: the scan runs off the event
loop, a voice added is picked up by an incremental scan that reads only it, and the registry swaps in one step."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
from served import FRAME_BYTES, ScriptedEngineDouble, body, serving

from llm_server.voices import CLONE, CLONE_FILE, VoicesDirectory

VOICES = 10_000
SLOW_STAT_S = 0.0002  # 10,000 voices: 2 s of stats a scan


def slow_stat(path: str) -> os.stat_result:
    time.sleep(SLOW_STAT_S)  # a network filesystem's round trip; the GIL is free meanwhile, as in a real stat
    return os.stat(path)


def make_clones(root, names) -> None:
    clone = json.dumps({"transcript": "Hello.", "language": "en", "frames": [[1, 2, 3, 4, 5, 6, 7]]})
    for name in names:
        (root / name).mkdir()
        (root / name / CLONE_FILE).write_text(clone)


class CountingDirectory(VoicesDirectory):
    """The worker's VoicesDirectory, counting the voices it reads (parses)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: list[str] = []

    def _voice(self, name, reading, registry):
        self.read.append(name)
        return super()._voice(name, reading, registry)


def lag_over(registry, bound_s: float) -> tuple[float, float]:
    """(loop-lag samples so far, of which over bound_s)."""
    count = registry.get_sample_value("orpheus_event_loop_lag_seconds_count")
    under = max(registry.get_sample_value("orpheus_event_loop_lag_seconds_bucket", {"le": le}) or 0
                for le in (f"{b}" for b in (0.02, 0.25)) if float(le) <= bound_s)
    return count, count - under


async def test_ten_thousand_clones_on_a_slow_filesystem_leave_a_live_stream_alone(snac_server, tmp_path):
    root = tmp_path / "voices"
    root.mkdir()
    make_clones(root, (f"clone-{i:05d}" for i in range(VOICES)))
    frames = 400  # 2 frames every 20 ms: 4 s of playing
    async with serving(snac_server, ScriptedEngineDouble(frames=frames, batch_delay_s=0.02), voices_dir=str(root),
                       voices_poll_s=0.2) as served:
        runtime = served.runtime
        runtime.voices_dir = directory = CountingDirectory(str(root), stat=slow_stat)
        registry = runtime.metrics.registry
        await runtime.refresh_voices()  # the first reading: every voice
        assert len(directory.read) == VOICES and runtime.voices.get("clone-09999").kind == CLONE
        directory.read.clear()
        before = lag_over(registry, 0.25)

        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            playing = asyncio.create_task(client.post("/v1/audio/speech", json=body("A long sentence meanwhile.")))
            await asyncio.sleep(0.5)
            make_clones(root, ["newcomer"])  # written while the watch scans every 0.2 s
            while runtime.voices.get("newcomer") is None:
                await asyncio.sleep(0.1)
            reply = await playing
        assert reply.status_code == 200 and len(reply.content) == frames * FRAME_BYTES
        assert directory.read == ["newcomer"]  # incremental: only what changed was read again
        assert len(runtime.voices.voices) == VOICES + 8 + 1  # the checkpoint's eight beside them

        samples, slow = (after - then for after, then in zip(lag_over(registry, 0.25), before))
        # The scans took seconds each; on the loop (the old code) every one of them was a stall.
        assert samples > 20 and slow == 0, (samples, slow)
