"""Host and Origin checks of ``mlxc serve``: no web page may drive a local server.

Without them, any page a user opens can POST to ``http://127.0.0.1:8000`` (a ``text/plain``
body needs no CORS preflight), and through DNS rebinding (``evil.example`` re-resolved to
127.0.0.1) even read the answers. Two rules, checked on every HTTP request before it reaches
the app (as Ollama and mlx-lm's server check them):

* **Host**: the ``Host`` header must name the server: ``localhost``, a loopback address, the
  bound address, an ``--allowed-hosts`` entry, or, when bound to every interface
  (``0.0.0.0`` / ``::``), any IP address or this machine's host name. A rebinding page sends
  its own name and is refused (403). ``--allowed-hosts '*'`` turns the check off.
* **Origin**: a browser names the page that sent the request; a request from another origin is
  refused (403) unless ``--allowed-origins`` lists it (or is ``*``). Those listed also get the
  CORS headers they need (preflight included). Requests without ``Origin`` (curl, SDKs) and
  same-origin ones pass.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

WILDCARD_BINDS = ("0.0.0.0", "::", "")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _hostname(host_header: str) -> str:
    """``Host`` header -> lower-case host name without port or IPv6 brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _origin(value: str) -> str:
    """An origin as compared: lower case, no trailing slash."""
    return value.strip().lower().rstrip("/")


class HostOriginGuard:
    """ASGI middleware applying the module's two rules (403 otherwise, OpenAI-shaped)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        bind_host: str,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
    ) -> None:
        hosts = {_hostname(h) for h in allowed_hosts}
        self.any_host = "*" in hosts
        self.wildcard_bind = bind_host in WILDCARD_BINDS
        self.hosts = hosts | set(LOOPBACK_NAMES) | {_hostname(bind_host)}
        if self.wildcard_bind:
            self.hosts.add(socket.gethostname().lower())
        origins = {_origin(o) for o in allowed_origins}
        self.any_origin = "*" in origins
        self.origins = origins - {"*"}
        # The listed origins get CORS headers (and preflight answers) from Starlette.
        self.app = (
            CORSMiddleware(
                app,
                allow_origins=["*"] if self.any_origin else sorted(self.origins),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
            )
            if origins
            else app
        )

    def host_allowed(self, host_header: str | None) -> bool:
        if self.any_host:
            return True
        if not host_header:  # HTTP/1.0 clients; browsers always send Host
            return True
        host = _hostname(host_header)
        if host in self.hosts or host.endswith(".localhost"):
            return True
        return self.wildcard_bind and _is_ip(host)

    def origin_allowed(self, origin: str | None, host_header: str | None) -> bool:
        if origin is None or self.any_origin:
            return True
        origin = _origin(origin)
        if origin in self.origins:
            return True
        # Same origin: a page served from this very host and port.
        parts = urlsplit(origin)
        return bool(host_header) and parts.netloc == host_header.strip().lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        host, origin = headers.get("host"), headers.get("origin")
        if not self.host_allowed(host):
            await _refuse(
                send,
                f"the Host header {host!r} does not name this server: start it with "
                "--allowed-hosts NAME to serve under that name",
                "host_not_allowed",
            )
        elif not self.origin_allowed(origin, host):
            await _refuse(
                send,
                f"requests from the web origin {origin!r} are not allowed: start the server "
                "with --allowed-origins ORIGIN to let that page use it",
                "origin_not_allowed",
            )
        else:
            await self.app(scope, receive, send)


async def _refuse(send: Send, message: str, code: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "permission_error", "param": None, "code": code}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
