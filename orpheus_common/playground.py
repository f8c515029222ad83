"""The playground page (playground.html), served at / by the front and by every worker: type, pick a voice and a
format, hear it as it streams, stop it (a barge-in), with time to first audio and the real-time factor shown."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import HTMLResponse

PAGE = Path(__file__).with_name("playground.html")


async def playground() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))
