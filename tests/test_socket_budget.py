"""Every socket door has a budget per connection (issue 41, item 6): a client flooding tiny messages is told so in
its door's protocol, then closed with 1008, before its flood is worked on, while another client's stream plays on
and nothing of either is left held; the front's relay closes a flood the worker has not stopped. The budget's
arithmetic on a clock of the test's own."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from served import FRAME_BYTES, NOTHING_HELD, ScriptedEngineDouble, baseline, body, serve_app, serving, settled, ws_url
from websockets.client import ClientProtocol
from websockets.protocol import State
from websockets.uri import parse_uri

from benchmarks.hostile_sockets import BUDGET_SAID, DOORS, flood
from orpheus_common.fair_websockets import CLOSE_REPLY_BYTES, FairWebSocketProtocol
from orpheus_common.socket_budget import SocketBudget, SocketLimits
from orpheus_front.front import create_front_app

LIMITS = SocketLimits(messages_per_s=10, message_burst=20, bytes_per_s=1000, byte_burst=2000, patience_s=1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_passes_a_flood_is_told_once_then_closed_after_patience():
    clock = Clock()
    budget = SocketBudget(LIMITS, clock)
    assert [budget.admit(10) for _ in range(20)] == [SocketBudget.OK] * 20
    assert budget.admit(10) == SocketBudget.TELL  # the burst is spent: said once
    clock.now = 0.5
    verdicts = [budget.admit(10) for _ in range(10)]
    assert verdicts[:5] == [SocketBudget.OK] * 5 and set(verdicts[5:]) == {SocketBudget.REFUSE}  # refilled 5
    clock.now = 1.0  # a flood that gets the refill's worth through is still one episode
    assert SocketBudget.CLOSE in [budget.admit(10) for _ in range(10)]


def test_a_client_that_lets_the_budget_refill_starts_afresh_and_bytes_count_apart_from_messages():
    clock = Clock()
    budget = SocketBudget(LIMITS, clock)
    for _ in range(21):
        budget.admit(1)
    clock.now = 1.5  # 15 messages' refill: over half the burst
    assert budget.admit(1) == SocketBudget.OK
    clock.now = 5.0
    assert budget.admit(1) == SocketBudget.OK and budget.admit(2500) == SocketBudget.TELL  # over the byte burst
    assert budget.admit(1) == SocketBudget.OK  # the refused message cost nothing


async def streamed(served, frames: int) -> bytes:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        reply = await client.post("/v1/audio/speech", json=body("One long sentence to play meanwhile."))
        assert reply.status_code == 200
        assert len(reply.content) == frames * FRAME_BYTES
        return reply.content


@pytest.mark.parametrize("door", sorted(DOORS))
async def test_a_flood_on_any_socket_door_is_told_then_closed_and_another_stream_plays_on(snac_server, door):
    frames = 160  # 2 frames every 20 ms: 1.6 s of playing while the flood goes on
    async with serving(snac_server, ScriptedEngineDouble(frames=frames, batch_delay_s=0.02)) as served:
        quiet = await baseline(served, snac_server)
        path, first, message = DOORS[door]
        playing = asyncio.create_task(streamed(served, frames))
        sent, code, texts = await asyncio.to_thread(flood, ws_url(served, path), first, message)
        await playing  # every byte of the other stream arrived
        assert code == 1008, (door, sent, code)
        assert any(BUDGET_SAID in text for text in texts), texts[-3:]
        # Refused unread; closed by the budget, or at once by a protocol whose errors close (Baseten's).
        refused = served.runtime.metrics.registry.get_sample_value
        assert refused("orpheus_socket_budget_refusals_total", {"action": "refused"}) >= 1
        assert (refused("orpheus_socket_budget_refusals_total", {"action": "closed"}) or 0) == (door != "baseten")
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_the_fronts_relay_closes_a_flood_too(snac_server):
    """Through the front, with the worker's budget lifted out of the way: the front's own budget stops it."""
    async with serving(snac_server, socket_messages_per_s=1e6, socket_bytes_per_s=1 << 30) as served, \
            serve_app(create_front_app([served.url])) as front_port:
        quiet = await baseline(served, snac_server)
        path, first, message = DOORS["elevenlabs"]
        _, code, _ = await asyncio.to_thread(flood, f"ws://127.0.0.1:{front_port}{path}", first, message)
        assert code == 1008
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


class CountingProtocol(FairWebSocketProtocol):
    """The stack's WebSocket protocol, counting what reaches it from the socket after its close frame went out."""

    made: list[CountingProtocol] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_after_close = 0
        CountingProtocol.made.append(self)

    def data_received(self, data: bytes) -> None:
        if self.close_sent:
            self.read_after_close += len(data)
        super().data_received(data)


async def close_at_once(scope, receive, send) -> None:
    """An app that closes every socket as the budget closes a flood: 1008 after the first message."""
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})
    await receive()
    await send({"type": "websocket.close", "code": 1008, "reason": "over this socket's message budget"})


async def test_a_client_that_sends_on_after_the_close_is_dropped_unread():
    """uvicorn reads on after its close until the peer's close arrives, parsing all a flooder has queued: megabytes
    of work after the budget closed the socket. Here the peer gets CLOSE_REPLY_BYTES, then it is no longer read, and
    a peer that reads still gets the close, its code and the end of the server's side."""
    flood_bytes = 4 << 20
    CountingProtocol.made.clear()
    async with serve_app(close_at_once, ws=CountingProtocol) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/"))
        client.send_request(client.connect())
        writer.write(b"".join(client.data_to_send()))
        while client.state is not State.OPEN:
            client.receive_data(await asyncio.wait_for(reader.read(65536), 30))
        client.send_text(b"hello")
        client.send_text(b" " * 100)
        first, frame = client.data_to_send()  # one frame sent over and over: masks need not differ

        async def read() -> str:  # as a client library does, beside its sending
            try:
                while data := await reader.read(65536):
                    client.receive_data(data)
            except ConnectionError as exc:  # a reset: uvicorn's close timer with the flood unread
                return repr(exc)
            return "end of stream"

        async def send() -> None:
            writer.write(first)
            for _ in range(flood_bytes // (1000 * len(frame))):
                writer.write(frame * 1000)
                await writer.drain()

        reading, sending = asyncio.create_task(read()), asyncio.create_task(send())
        try:
            ended = await asyncio.wait_for(reading, 30)  # the server's close frame, then the end of its side
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            writer.close()
        [server_side] = CountingProtocol.made
        assert server_side.read_after_close <= CLOSE_REPLY_BYTES + (256 << 10), server_side.read_after_close
        assert client.close_rcvd is not None and client.close_rcvd.code == 1008
        assert ended == "end of stream", ended  # half-closed after the close frame, not reset
