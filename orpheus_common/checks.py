"""The shape of a self-check's result, as each tier's self-check (snac_server/selfcheck.py,
llm_server/selfcheck.py) and `megapod doctor` report it: {"ok": bool, "detail": str, ...}."""

from __future__ import annotations

import traceback


def failed(exc: BaseException) -> dict[str, object]:
    """A part that raised, as a failed check: its error and where it came from."""
    return {"ok": False, "detail": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=-4)}
