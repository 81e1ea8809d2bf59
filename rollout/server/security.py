"""What keeps a browser page away from the server: a page may send a
cross-site POST without a preflight only as a form content type, so bodies
must be `application/json` (no CORS headers are ever sent, so a browser never
lets a page send that cross-site); and a page on a rebinding domain reaches a
loopback server with its own name in `Host`, so a loopback bind answers only
loopback names. A server that others can reach needs a key."""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError

JSON = "application/json"


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address or a `Host` name, without port or brackets) is this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name, or "" (all interfaces): reachable from elsewhere


def check_bind(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """Refuse to serve without a key on an address other machines can reach,
    unless `allow_no_key`; raises `ValueError` naming the options."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str (an address or a name to bind), got {type(host).__name__}")
    if api_key is None and not allow_no_key and not is_loopback(host):
        raise ValueError(
            f"host {host!r} is reachable from other machines and no API key is set: set ROLLOUT_API_KEY, "
            "--api-key-file or --api-key (or pass --allow-no-key to serve it open)"
        )


def check_json(content_type: str | None) -> None:
    """A 415 unless the body is declared `application/json` (parameters such as charset allowed)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON:
        raise APIError(
            415,
            f"Content-Type must be {JSON}, got {content_type!r}",
            "Content-Type",
            "unsupported_media_type",
        )


def host_name(header: str) -> str:
    """The name of a `Host` header: `[::1]:8000` -> `::1`, `localhost:80` -> `localhost`."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class LoopbackHosts:
    """ASGI middleware for a loopback bind: a request whose `Host` is not a
    loopback name (localhost, 127.0.0.1, [::1], any port) gets a 421 (DNS
    rebinding). Starlette's TrustedHostMiddleware misreads IPv6 literals and
    answers in its own shape, hence this one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not is_loopback(host_name(header)):
                message = f"Host {header!r} is not a loopback name; this server answers localhost, 127.0.0.1 or [::1]"
                await APIError(421, message, "Host", "misdirected_request").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
