"""The Host allowlist: a defence against DNS rebinding.

A web page on evil.example can point its own name at 127.0.0.1 once the browser has loaded it
(DNS rebinding); its scripts then talk to a server on this machine as "same origin", read the
answers and spend its compute. The one thing such a request cannot hide is its Host header,
which names the attacker's domain. So a server that listens on a loopback address answers only
to loopback names unless told otherwise (`dspark serve --allowed-hosts`).
"""

from __future__ import annotations

import ipaddress

from fastapi.responses import JSONResponse

from dspark.serve.protocol import APIError, quote

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
ANY = "*"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def parse_allowed(flag: str | None, bind_host: str) -> tuple[str, ...] | None:
    """The names the server answers to; None: any. `flag` is --allowed-hosts ("a,b", "*")."""
    if flag is not None:
        names = tuple(n.strip().lower() for n in flag.split(",") if n.strip())
        return None if ANY in names else names
    # a server bound elsewhere is reached under names this machine cannot know: as before, any
    return LOOPBACK_NAMES if is_loopback(bind_host) else None


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "[::1]", "a:80" -> "a"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostGuard:
    """ASGI middleware: a request whose Host header is not allowed gets a 403 naming the setting,
    before anything else about it is looked at (route, key, body)."""

    def __init__(self, app, allowed: tuple[str, ...] | None):
        self.app, self.allowed = app, allowed

    def admits(self, header: str | None) -> bool:
        if self.allowed is None:
            return True
        if header is None:
            return False
        return host_name(header) in self.allowed or header.strip().lower() in self.allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.allowed is None:
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if self.admits(header):
            return await self.app(scope, receive, send)
        await refusal(header, self.allowed)(scope, receive, send)


def refusal(header: str | None, allowed: tuple[str, ...]) -> JSONResponse:
    got = "no Host header" if header is None else f"the Host header {quote(header)}"
    name = host_name(header)[:64] if header else "NAME"
    err = APIError(
        403,
        f"{got} is not one this server answers to (allowed: {', '.join(allowed)}); a web page can reach a "
        f"server on this machine under its own name (DNS rebinding), so other names are refused. To allow it, "
        f"start dspark serve with --allowed-hosts {name} (a comma list; '*' allows any)",
        code="host_not_allowed",
    )
    return JSONResponse(err.body(), status_code=403)
