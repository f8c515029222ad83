"""uvicorn's WebSocket protocol, parsing what one read brings a slice per event-loop turn.

A read from a socket returns up to 256 KiB (asyncio's transports), and uvicorn's sans-I/O protocol parses every
frame in it in the one callback. From a client flooding tiny messages that is ~5,000 frames, a few hundred ms
of parsing during which every other stream of the process waits (measured with benchmarks/hostile.py: loop lag
p99 of 150 to 445 ms while a socket flooded, before its budget closed it). Parsed `SLICE_BYTES` at a time, with
the loop's other callbacks between slices, a flood costs the other streams a few ms at a time; the bytes not
yet parsed are bounded (reading pauses past `HELD_BYTES`).
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

SLICE_BYTES = 4096  # ~80 tiny frames, a few ms; a large message is parsed over several turns
HELD_BYTES = 1 << 20


class FairWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unparsed = bytearray()
        self._parsing = False  # a slice is scheduled
        self._held = False  # reading paused here for the bytes held

    def data_received(self, data: bytes) -> None:
        self._unparsed += data
        if len(self._unparsed) > HELD_BYTES:  # again after uvicorn's receive() resumed reading meanwhile
            self._held = True
            self.transport.pause_reading()
        if not self._parsing:
            self._parse_slice()

    def _parse_slice(self) -> None:
        data = bytes(self._unparsed[:SLICE_BYTES])
        del self._unparsed[:SLICE_BYTES]
        super().data_received(data)
        if self._unparsed and not self.transport.is_closing():
            self._parsing = True
            self.loop.call_soon(self._parse_slice)
            return
        self._parsing = False
        if self._held:
            self._held = False
            if not self.read_paused:  # uvicorn's own pause (a message waiting for the app) resumes on its own
                self.transport.resume_reading()
