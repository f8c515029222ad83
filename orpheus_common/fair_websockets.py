"""uvicorn's WebSocket protocol, parsing what one read brings a slice per event-loop turn, and giving up on a peer
that goes on sending after the server's close.

A read from a socket returns up to 256 KiB (asyncio's transports), and uvicorn's sans-I/O protocol parses every
frame in it in the one callback. From a client flooding tiny messages that is ~5,000 frames, a few hundred ms
of parsing during which every other stream of the process waits (measured with benchmarks/hostile.py: loop lag
p99 of 150 to 445 ms while a socket flooded, before its budget closed it). Parsed `SLICE_BYTES` at a time, with
the loop's other callbacks between slices, a flood costs the other streams a few ms at a time; the bytes not
yet parsed are bounded (reading pauses past `HELD_BYTES`).

After the server's close frame uvicorn reads on until the peer's own close arrives (up to its 10 s close timeout),
parsing and discarding every frame before it: a flooder closed by its budget (orpheus_common/socket_budget.py)
has megabytes queued in the kernel's buffers by then, and the process spent seconds of CPU parsing them. A peer
gets `CLOSE_REPLY_BYTES` after the server's close to answer with its own (a well-behaved one needs a few bytes);
past that it is no longer read. A client whose close reply comes behind more than that (one read that crosses the
bound, or a backlog from before the close) is treated as the flooder it looks like: it still gets our close frame
and its code, then the end of our side, and uvicorn's close timer ends the connection.

A server's drain asks every connection to shut down; one whose client is closing (its close answered, the
transport not yet gone: TLS waits for its close_notify exchange) is only let go, not sent a second close.
"""

from __future__ import annotations

import logging

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

log = logging.getLogger(__name__)

SLICE_BYTES = 4096  # ~80 tiny frames, a few ms; a large message is parsed over several turns
HELD_BYTES = 1 << 20
CLOSE_REPLY_BYTES = 64 * 1024  # what a peer may send after the server's close before its own close frame


class FairWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unparsed = bytearray()
        self._parsing = False  # a slice is scheduled
        self._held = False  # reading paused here for the bytes held
        self._after_close = 0  # bytes that arrived after the server's close frame went out
        self._dropped = False  # the peer sent on after our close: not read again

    def shutdown(self) -> None:
        """uvicorn's shutdown sends a close (1012) on any connection whose handshake completed and has not sent one:
        on one the client is closing, websockets refuses (InvalidState), and the exception ended the server's drain."""
        if self.handshake_complete and not self.close_sent and self.conn.state in (State.CLOSING, State.CLOSED):
            self.stop_keepalive()
            self.transport.close()
            return
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._dropped:  # reading is paused: nothing after the drop is parsed
            return
        if self.close_sent:
            self._after_close += len(data)
        self._unparsed += data
        if self._overran_our_close():
            self._drop_peer()
            return
        if len(self._unparsed) > HELD_BYTES:  # again after uvicorn's receive() resumed reading meanwhile
            self._held = True
            self.transport.pause_reading()
        if not self._parsing:
            self._parse_slice()

    def _parse_slice(self) -> None:
        if self._dropped or self.transport.is_closing():
            self._parsing = False
            return
        data = bytes(self._unparsed[:SLICE_BYTES])
        del self._unparsed[:SLICE_BYTES]
        super().data_received(data)
        if self._unparsed and not self.transport.is_closing():
            if self._overran_our_close():
                self._drop_peer()
                return
            self._parsing = True
            self.loop.call_soon(self._parse_slice)
            return
        self._parsing = False
        if self._held:
            self._held = False
            if not self.read_paused:  # uvicorn's own pause (a message waiting for the app) resumes on its own
                self.transport.resume_reading()

    def _overran_our_close(self) -> bool:
        """Our close went out and the peer has sent, or still has unparsed from before it, more than a close reply."""
        return self.close_sent and max(self._after_close, len(self._unparsed)) > CLOSE_REPLY_BYTES

    def _drop_peer(self) -> None:
        """Our close went out and the peer sends on instead of answering it: nothing more is read or parsed (what it
        sent waits in the kernel's buffers, then its own), our side is half-closed after the close frame so that a
        peer that reads learns the close and its code, and uvicorn's close timer ends the connection. Closing it
        now would reset it with data unread, and a reset can take the close frame with it."""
        self._dropped = True
        log.warning("a WebSocket client %s sent over %d KiB after the server's close frame without closing: no longer "
                    "read", self.client, CLOSE_REPLY_BYTES // 1024)
        self._unparsed.clear()  # a slice already scheduled finds nothing to do (_parse_slice)
        self.transport.pause_reading()
        if self.transport.can_write_eof():  # TLS cannot half-close: its peer learns at the close timer
            self.transport.write_eof()
