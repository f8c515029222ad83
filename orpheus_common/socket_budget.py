"""What one client socket may send, judged before any work is done for a message.

A voice agent sends a handful of messages a second (an LLM's tokens or sentences, flushes, keep-alives); a
socket sending thousands a second is a flood, and every message it gets handled for is loop time the
other streams of the process do not get. Each socket has two token buckets, messages and bytes, that
refill at a steady rate up to a burst. A message over budget is refused unread (the door says so in its
protocol, once per episode) and the socket is not read again until the buckets have refilled for one more
(backpressure: a flood then waits in the kernel's buffers, not in this process's CPU); a socket whose episode
lasts `patience_s` (its buckets never half refill) is closed with 1008 (policy violation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

POLICY_VIOLATION = 1008


@dataclass(frozen=True)
class SocketLimits:
    messages_per_s: float = 200.0  # sustained; an LLM's tokens one message each stay far below
    message_burst: float = 1000.0  # a whole reply's tokens sent at once
    bytes_per_s: float = 256 * 1024.0
    byte_burst: float = 1024 * 1024.0  # at least one largest message (llm_server/doors/sockets.py, MAX_MESSAGE_CHARS)
    patience_s: float = 0.5  # over budget this long after the first refusal: closed (every message parsed costs)


class _Bucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.level, self.at = burst, now

    def take(self, amount: float, now: float) -> bool:
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if amount > self.level:
            return False
        self.level -= amount
        return True


class SocketBudget:
    """One socket's budget. `admit(size)` for each message received: "ok", "refuse" (drop it and, the first time
    in an episode, tell the client) or "close" (the flood persisted past patience_s)."""

    OK, REFUSE, TELL, CLOSE = "ok", "refuse", "tell", "close"

    def __init__(self, limits: SocketLimits = SocketLimits(), clock=time.monotonic) -> None:
        self.limits, self._clock = limits, clock
        now = clock()
        self._messages = _Bucket(limits.messages_per_s, limits.message_burst, now)
        self._bytes = _Bucket(limits.bytes_per_s, max(limits.byte_burst, 1.0), now)
        self._over_since: float | None = None  # the first refusal of the current episode
        self.refused = 0

    def admit(self, size: int) -> str:
        """OK; TELL (refused, the first of an episode: say why); REFUSE (refused, already said); CLOSE."""
        now = self._clock()
        # Bytes are taken only when the message is: a refused message costs its sender nothing it could save up.
        if self._messages.take(1, now):
            if self._bytes.take(size, now):
                # The episode ends once the sender has let the buckets half refill, not at the odd message a
                # flood gets through at the refill rate.
                if self._over_since is not None and self._messages.level >= self._messages.burst / 2 \
                        and self._bytes.level >= self._bytes.burst / 2:
                    self._over_since = None
                return self.OK
            self._messages.level += 1
        self.refused += 1
        if self._over_since is None:
            self._over_since = now
            return self.TELL
        return self.CLOSE if now - self._over_since >= self.limits.patience_s else self.REFUSE

    def refill_s(self) -> float:
        """How long until one more message fits: a socket over budget is not read meanwhile (its flood waits in the
        kernel's buffers and then its sender's, costing this process nothing)."""
        return 1.0 / self.limits.messages_per_s

    def why(self) -> str:
        lim = self.limits
        return (f"this socket is over its budget of {lim.messages_per_s:g} messages and {lim.bytes_per_s / 1024:g} KiB a "
                f"second (bursts of {lim.message_burst:g} and {lim.byte_burst / 1024:g} KiB): messages are refused "
                f"unread, and the socket is closed if it goes on for {lim.patience_s:g} s")
