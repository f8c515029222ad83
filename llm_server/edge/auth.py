"""Optional API keys on /v1/*, /tts/* and /voices (HTTP and WebSocket handshakes), each key name with its own
stream cap. Each protocol's clients send the key their own way: `Authorization: Bearer` (OpenAI, SLNG),
`Authorization: Token` (Deepgram), `X-API-Key` or an `api_key` query parameter (Cartesia, whose voice list is
/voices), `xi-api-key` (ElevenLabs), `Authorization: Api-Key` (Baseten, whose paths are /environments/*, and
LiveKit's Baseten plugin on vLLM-Omni's /v1/audio/speech/stream).

The keys file holds lines `name:key[:max_streams[:permissions]]` (`#` comments and blank lines allowed);
permissions, comma-separated, grant more than speaking: `voices` creates and deletes voices (clones.py). A
name may have several keys, so during a rotation the old and the new key both work; they share
the name's stream cap. The file is re-read when its mtime or size changes (a mounted Secret
being updated); a file that no longer parses keeps the previous keys and logs an error, while
a broken file at startup stops the worker. Keys never reach a log line; only names do.
/health, /ready and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from orpheus_common.http import error_response

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"\S{8,512}")
PROTECTED_PREFIXES = ("/v1/", "/tts/", "/environments/", "/voices")
PERMISSIONS = frozenset({"voices"})


class ApiKeysError(ValueError):
    """The keys file is missing, unreadable or malformed (the message never contains a key)."""


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: the name it is known by (logs, metrics, caps) and its stream cap."""

    name: str
    secret: bytes
    max_streams: int = 0  # 0: only the worker-wide cap applies
    permissions: frozenset[str] = frozenset()


def parse_keys(text: str) -> tuple[ApiKey, ...]:
    """Lines `name:key[:max_streams[:permissions]]` -> keys; raises ApiKeysError naming the line, never its key."""
    keys: list[ApiKey] = []
    caps: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) not in (2, 3, 4) or not _NAME.fullmatch(parts[0]) or not _KEY.fullmatch(parts[1]):
            raise ApiKeysError(f"line {number}: expected name:key[:max_streams[:permissions]] (name [A-Za-z0-9._-], "
                               "key 8+ characters)")
        cap = parts[2] if len(parts) >= 3 and parts[2] else "0"
        permissions = frozenset(p.strip() for p in parts[3].split(",") if p.strip()) if len(parts) == 4 else frozenset()
        if unknown := permissions - PERMISSIONS:
            raise ApiKeysError(f"line {number}: unknown permission {sorted(unknown)}; there is {sorted(PERMISSIONS)}")
        if not cap.isdigit():
            raise ApiKeysError(f"line {number}: max_streams must be a whole number")
        if caps.setdefault(parts[0], int(cap)) != int(cap):
            raise ApiKeysError(f"line {number}: name {parts[0]!r} has another max_streams on an earlier line")
        keys.append(ApiKey(parts[0], parts[1].encode(), int(cap), permissions))
    if not keys:
        raise ApiKeysError("no keys in the file")
    if len({k.secret for k in keys}) != len(keys):
        raise ApiKeysError("the same key appears twice")
    return tuple(keys)


class ApiKeys:
    """The keys of one file, re-read when the file changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        if self._stamp is None:
            raise ApiKeysError(f"api_keys_file {path!r} cannot be read")
        self._keys = self._load()

    def lookup(self, token: str) -> ApiKey | None:
        """The key `token` is, or None. Every key is compared, in constant time, whatever matches."""
        self._reload_if_changed()
        candidate = token.encode()
        found = None
        for key in self._keys:
            if hmac.compare_digest(candidate, key.secret):
                found = key
        return found

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _load(self) -> tuple[ApiKey, ...]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeysError(f"api_keys_file {self.path!r} cannot be read: {type(exc).__name__}") from None
        try:
            return parse_keys(text)
        except ApiKeysError as exc:
            raise ApiKeysError(f"api_keys_file {self.path!r}: {exc}") from None

    def _reload_if_changed(self) -> None:
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return  # a file missing mid-swap keeps the keys we have
        self._stamp = stamp  # once per change: a broken file is reported once, not per request
        try:
            keys = self._load()
        except ApiKeysError as exc:
            log.error("%s; keeping the %d key(s) loaded before", exc, len(self._keys))
            return
        self._keys = keys
        log.info("api keys reloaded: %d key(s) for %d name(s)", len(keys), len({k.name for k in keys}))


def presented_key(scope: Scope) -> str | None:
    """The key a request presents, the way its protocol sends it; None when it has none."""
    headers = Headers(scope=scope)
    scheme, token = get_authorization_scheme_param(headers.get("authorization"))
    if scheme.lower() in ("bearer", "token", "api-key") and token.strip():
        return token.strip()
    for header in ("x-api-key", "xi-api-key"):
        if headers.get(header, "").strip():
            return headers[header].strip()
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query["api_key"][0].strip() if query.get("api_key", [""])[0].strip() else None


class ApiKeyMiddleware:
    """Pure ASGI, ahead of the body: requests to a protected path without a known key get 401 before
    their body is read (a WebSocket handshake gets 403); an accepted key goes to the endpoint as
    `request.state.api_key` (`websocket.state.api_key`)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, on_refused=None) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused or (lambda: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        token = presented_key(scope)
        key = self.keys.lookup(token) if token else None
        if key is None:
            self.on_refused()
            log.info("refused %s: %s API key", scope["path"], "invalid" if token else "no")
            if scope["type"] == "websocket":  # closed before accept: the handshake gets 403
                await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
                return
            message = "invalid API key" if token else "missing API key: send Authorization: Bearer <key>"
            await error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)

