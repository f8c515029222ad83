"""What the socket doors (Cartesia, Deepgram, ElevenLabs, Baseten, Together, vLLM-Omni, SLNG) share: a socket accepted
or refused at connect, one writer per socket, the message budget, text limits, sessions spoken in turn, and how a
context's audio ends and is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from orpheus_common.http import TRY_AGAIN_LATER
from orpheus_common.socket_budget import POLICY_VIOLATION, SocketBudget

from ..admission import CAPACITY
from ..edge.auth import ApiKey
from ..speech.session import ClientTooSlow, PromptTooLong, Refused, SpeechSession, SpeechSpec

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 65_536  # one text message; longer ones are refused, not parsed
MAX_CONTEXTS = 64  # open contexts (or queued flush groups) per socket


class SocketGone(Exception):
    """The client's socket is closed: whatever was being made for it can stop."""


class SocketWriter:
    """Sends for every task of one socket, one at a time."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self._lock = asyncio.Lock()
        self.gone = False

    async def json(self, message: dict) -> None:
        """Send, or raise SocketGone."""
        await self._send(lambda: self.ws.send_text(json.dumps(message)))

    async def bytes(self, data: bytes) -> None:
        """Send, or raise SocketGone."""
        await self._send(lambda: self.ws.send_bytes(data))

    async def tell(self, message: dict) -> None:
        """Send if the socket is still there (errors, warnings): never raises."""
        try:
            await self.json(message)
        except SocketGone:
            pass

    async def close(self, code: int = 1000, reason: str = "") -> None:
        async with self._lock:
            if not self.gone and self.ws.client_state == WebSocketState.CONNECTED:
                self.gone = True
                try:
                    await self.ws.close(code, reason)
                except (RuntimeError, WebSocketDisconnect, OSError):
                    pass

    async def _send(self, send) -> None:
        async with self._lock:
            if self.gone:
                raise SocketGone
            try:
                await send()
            except (RuntimeError, WebSocketDisconnect, OSError):  # the client went away mid-send
                self.gone = True
                raise SocketGone from None


async def accept(ws: WebSocket) -> tuple[object, ApiKey | None] | None:
    """A door's socket accepted: the worker's runtime and the handshake's API key (edge/auth.py). None when every
    stream slot is taken: then the socket is closed at once with 1013."""
    runtime = ws.app.state.runtime
    await ws.accept()
    if not runtime.admission.free:
        await ws.close(TRY_AGAIN_LATER, f"server at its limit of {runtime.admission.max_streams} concurrent streams")
        runtime.metrics.refused(CAPACITY)
        return None
    return runtime, ws.scope.get("state", {}).get("api_key")


async def refuse_socket(out: SocketWriter, message: dict, reason: str) -> None:
    """The socket's own settings are wrong (nothing can be spoken on it): the protocol's error, then 1008."""
    await out.tell(message)
    await out.close(POLICY_VIOLATION, reason)


async def client_messages(ws: WebSocket, out: SocketWriter, runtime, refuse: Callable[[str], Awaitable[None]],
                          max_chars: int = MAX_MESSAGE_CHARS) -> AsyncIterator[str | None]:
    """The text of each message the client sends (None for a binary frame), until it goes, within the socket's
    budget (orpheus_common/socket_budget.py): a message over it is dropped unread, `refuse(why)` tells the client in
    the door's protocol once an episode, the socket is not read until the budget has room again, and a flood that
    goes on is closed with 1008. `max_chars`: the door's largest message (vLLM-Omni's voice.add carries a recording);
    one up to it but over the budget's byte burst costs the whole burst, so it passes only on a socket that has sent
    little for a while (one per burst's refill), and the door judges it."""
    limits = runtime.config.socket_limits
    budget = SocketBudget(limits)
    try:
        while not out.gone:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            size = len(text) if text is not None else len(message.get("bytes") or b"")
            verdict = budget.admit(min(size, limits.byte_burst) if size <= max_chars else size)
            message = None  # nothing of a message is kept past its turn: a voice.add's is a whole recording
            if verdict == SocketBudget.OK:
                yield text
                text = None
                # Queued messages are received without a pause: a backlog must not hold the loop from other streams.
                await asyncio.sleep(0)
                continue
            text = None
            if verdict == SocketBudget.CLOSE:
                runtime.metrics.socket_refused.labels("closed").inc()
                log.warning("a client socket on %s went on over its budget (%d messages refused): closed", ws.url.path,
                            budget.refused)
                await out.close(POLICY_VIOLATION, "over this socket's message budget")
                return
            runtime.metrics.socket_refused.labels("refused").inc()
            if verdict == SocketBudget.TELL:
                await refuse(budget.why())
            await asyncio.sleep(budget.refill_s())  # not read meanwhile: the flood waits in its sender's buffers
    except WebSocketDisconnect:
        return


def parse_message(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> dict:
    """A client's JSON message; ValueError with the reason when it is not one."""
    if len(text) > max_chars:
        raise ValueError(f"message of {len(text)} characters is over the limit of {max_chars}")
    message = json.loads(text)
    if not isinstance(message, dict):
        raise ValueError("a message must be a JSON object")
    return message


@contextlib.asynccontextmanager
async def context_audio(session: SpeechSession, out: SocketWriter,
                        report: Callable[[str, bool], Awaitable[None]]) -> AsyncIterator[None]:
    """Around the sending of one context's audio, however it ends: a client too far behind real time is cut
    off (1008), a vanished one cancels the session, and a failure not yet told is reported in the protocol's
    shape (`report(text, bad_input)`: bad_input for a prompt the context cannot hold)."""
    try:
        yield
    except ClientTooSlow:
        await out.close(1008, "client too slow: too far behind real time")
    except SocketGone:
        session.cancel("disconnected")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if session.failed(exc):
            bad_input = isinstance(exc, PromptTooLong)
            await report(str(exc) if bad_input else f"speech generation failed: {exc}", bad_input)


@contextlib.asynccontextmanager
async def queued_audio(session: SpeechSession, out: SocketWriter, report: Callable[[str, bool], Awaitable[None]],
                       live: list[SpeechSession]) -> AsyncIterator[None]:
    """context_audio for a session a socket plays in its turn (Deepgram's and SLNG's flush groups, vLLM-Omni's
    utterances): however it ends, it leaves `live` (those not yet played out) and releases what it holds."""
    try:
        async with context_audio(session, out, report):
            yield
    finally:
        if session in live:
            live.remove(session)
        await session.close()


async def stop_context(session: SpeechSession, sender: asyncio.Task | None, outcome: str) -> None:
    """Stop a context's audio now and release what it holds: engine request, codec stream, slot."""
    await stop_sessions([session], sender, outcome)


async def stop_sessions(sessions: list[SpeechSession], sender: asyncio.Task | None, outcome: str) -> None:
    """Stop these sessions' audio now (the task sending it too) and release what each holds; `sessions` is emptied."""
    for session in list(sessions):
        session.cancel(outcome)
    if sender is not None:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    for session in list(sessions):
        await session.close()
    sessions.clear()


class NotSpoken(Exception):
    """Text a socket's turn did not take: `kind` is BUSY (MAX_CONTEXTS turns waiting), REFUSED (admission: the
    message says why) or TOO_LONG (past max_input_chars in one turn); each door answers in its protocol's words."""

    BUSY, REFUSED, TOO_LONG = "busy", "refused", "too_long"

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(message)
        self.kind = kind


_CLOSE = object()  # close()'s place among the turns


class Turns:
    """A socket's sessions spoken in turn (Deepgram's and SLNG's flush groups, vLLM-Omni's utterances): text goes to
    the current turn's session, opened on its first text; end() ends it (with none open, an empty turn); one sender
    task plays the turns in order, `play(tag, session or None)` each, and at close()'s place `closed()`. A client
    gone while they play cancels every turn still queued; stop() stops and releases them all at once."""

    def __init__(self, out: SocketWriter, runtime, key: ApiKey | None,
                 play: Callable[[object, SpeechSession | None], Awaitable[None]],
                 closed: Callable[[], Awaitable[None]] | None = None) -> None:
        self.out, self.runtime, self.key = out, runtime, key
        self._play_turn, self._closed = play, closed
        self.current: SpeechSession | None = None  # the turn receiving text
        self._chars = 0  # the current turn's text so far
        self.live: list[SpeechSession] = []  # every turn not yet played out
        self._queue: asyncio.Queue = asyncio.Queue()  # (tag, session or None), or _CLOSE
        self.sender = asyncio.create_task(self._play())

    async def text(self, text: str, spec: Callable[[], SpeechSpec], request_id: str, tag: object = None) -> None:
        """`text` to the current turn, opening one (spec(), request_id; queued with `tag`) if none is; NotSpoken
        when it is not taken."""
        if self.current is None:
            if len(self.live) >= MAX_CONTEXTS:
                raise NotSpoken(NotSpoken.BUSY)
            try:
                self.current = await SpeechSession.open(self.runtime, spec(), self.key, request_id)
            except Refused as exc:
                raise NotSpoken(NotSpoken.REFUSED, str(exc)) from None
            self._chars = 0
            self.live.append(self.current)
            self._queue.put_nowait((tag, self.current))
        self._chars += len(text)
        if self._chars > self.runtime.config.max_input_chars:
            raise NotSpoken(NotSpoken.TOO_LONG)
        self.current.push(text)

    def end(self, tag: object = None) -> None:
        """The current turn's text is all there; with none open, an empty turn (`tag`) plays in its place."""
        if self.current is not None:
            self.current.end_input()
            self.current = None
        else:
            self._queue.put_nowait((tag, None))

    def close(self) -> None:
        """After the turns queued: closed()."""
        self._queue.put_nowait(_CLOSE)

    async def stop(self, outcome: str) -> None:
        """Barge-in or a vanished client: every turn stops now and releases what it holds (no sender after)."""
        self.current = None
        await stop_sessions(self.live, self.sender, outcome)
        self._queue = asyncio.Queue()

    async def clear(self) -> None:
        """Every turn stopped, and a new sender for the turns to come."""
        await self.stop("cancelled")
        self.sender = asyncio.create_task(self._play())

    async def _play(self) -> None:
        try:
            while (turn := await self._queue.get()) is not _CLOSE:
                await self._play_turn(*turn)
            if self._closed is not None:
                await self._closed()
        except SocketGone:  # the client left: what is still queued stops (the door's stop() releases it)
            for session in list(self.live):
                session.cancel("disconnected")
