"""What every page of the dashboard shares, one shard's or every shard's: where its files
are, the templates and their filters, the guards around the ASGI app (security headers,
the ``Host`` check), and the checks of ``create_app``'s arguments.

Internal. It sits below both :mod:`sqla_jobs.web.app` (one database's dashboard) and
:mod:`sqla_jobs.web.shards` (the page over several), so that neither imports the other
for these: ``app`` builds the shards' page, and ``shards`` knows nothing of ``app``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

import jinja2
import sqlalchemy as sa
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import _present
from ..db import create_engine

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "HERE",
    "SECURITY_HEADERS",
    "Authorize",
    "Mounted",
    "SecurityHeaders",
    "TrustedHosts",
    "check_allowed_hosts",
    "engine_of",
    "read_only_of",
    "templates",
]

log = logging.getLogger("sqla_jobs.web")

HERE = Path(__file__).resolve().parent

#: The hosts a dashboard answers for unless told otherwise: a browser tricked into
#: sending a request for another name (DNS rebinding) gets a refusal, not the page.
DEFAULT_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "[::1]")

Authorize = Callable[[Request], bool]

#: Security headers on every response. No inline script or style may run: a job's
#: arguments are escaped already, and this is the second line.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"SAMEORIGIN"),
]


def check_allowed_hosts(hosts: Iterable[str]) -> tuple[str, ...]:
    """``allowed_hosts`` as the host check compares them (lower case, an IPv6 address in
    brackets); ``ValueError`` names a pattern that cannot match a ``Host`` header."""
    if isinstance(hosts, str):
        raise ValueError(f"allowed_hosts must be a list of host names, got the string {hosts!r}")
    checked: list[str] = []
    for host in hosts:
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"allowed_hosts: {host!r} is not a host name")
        name = host.strip().lower()
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"  # an IPv6 address, as a Host header writes it
        wildcard = name.startswith("*.") and "*" not in name[2:]
        if name != "*" and not wildcard and not _HOST_NAME.fullmatch(name):
            raise ValueError(
                f"allowed_hosts: {host!r} is not a host name, an address, '*.domain' or "
                "'*' (give no scheme, port or path)"
            )
        checked.append(name)
    if not checked:
        raise ValueError("allowed_hosts names no host (give ['*'] to answer for any)")
    return tuple(checked)


#: A host name or IPv4 address, or an IPv6 address in brackets, without a port.
_HOST_NAME = re.compile(r"[a-z0-9_.-]+|\[[0-9a-f:.]+\]")


def _host_of(header: str) -> str | None:
    """The host of a ``Host`` header, lower case and without its port; None if malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        host, rest = header[: end + 1], header[end + 1 :]
    else:
        host, colon, port = header.partition(":")
        host, rest = host.rstrip("."), colon + port  # "localhost." is localhost
    if rest and not (rest[0] == ":" and rest[1:].isascii() and rest[1:].isdigit()):
        return None
    return host if host and _HOST_NAME.fullmatch(host) else None


class TrustedHosts:
    """Answers only requests whose ``Host`` is one of ``hosts`` (see
    :func:`check_allowed_hosts`). A page that rebinds its own name to 127.0.0.1 (DNS
    rebinding) makes the browser send its own name as ``Host``: refused, so it can read
    neither the jobs nor a CSRF token. Written here rather than taken from Starlette's
    ``TrustedHostMiddleware``, whose releases before 1.0 split ``[::1]:8080`` at its
    first colon."""

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...]) -> None:
        self.app = app
        self.any = "*" in hosts
        self.names = frozenset(h for h in hosts if not h.startswith("*"))
        self.suffixes = tuple(h[1:] for h in hosts if h.startswith("*."))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.any or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"host"), b"")
        host = _host_of(header.decode("latin-1"))
        if host is not None and (host in self.names or host.endswith(self.suffixes)):
            await self.app(scope, receive, send)
            return
        shown = header.decode("latin-1")[:100]
        response = PlainTextResponse(
            f"This dashboard does not answer for the host {shown!r}. Its allowed hosts are "
            "set by create_app(..., allowed_hosts=[...]) or sqla-jobs web --allowed-host.",
            status_code=400,
            headers={k.decode(): v.decode() for k, v in SECURITY_HEADERS},
        )
        await response(scope, receive, send)


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response of the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Mounted(Protocol):
    """A dashboard as the page over shards sees it: its engine, and its ASGI app."""

    @property
    def engine(self) -> sa.Engine: ...

    @property
    def app(self) -> ASGIApp: ...


@jinja2.pass_context
def _ago(context: Any, value: Any) -> str:
    """``ago`` from the page's ``now`` (the database's clock, see ``Dashboard.now``)."""
    return _present.ago(value, context.get("now"))


def templates() -> jinja2.Environment:
    """The dashboard's templates, autoescaped, with the filters they write values with
    (:mod:`sqla_jobs._present`)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=jinja2.select_autoescape(["html"], default=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        thousands=_present.thousands,
        duration=lambda value: _present.duration(value, spaced=True),
        clock=_present.clock,
        ago=_ago,
        urlencode=lambda value: urlencode({"": value})[1:],
    )
    return env


def read_only_of(read_only: bool | None, authorize: Authorize | None) -> bool:
    """Whether a dashboard refuses every action: as given, else unless ``authorize`` is.
    Actions without ``authorize`` are logged, once per app: anyone may take them."""
    effective = read_only if read_only is not None else authorize is None
    if not effective and authorize is None:
        log.warning(
            "sqla_jobs.web: actions are enabled for anyone who can reach this dashboard "
            "(read_only=False without authorize=); put it behind your authentication"
        )
    return effective


def engine_of(what: str, engine: Any) -> sa.Engine:
    """``engine``, or the engine of a database URL; ``TypeError`` for anything else."""
    if isinstance(engine, str):
        engine = create_engine(engine)
    if not isinstance(engine, sa.Engine):
        raise TypeError(f"{what} must be a SQLAlchemy Engine or a URL, got {engine!r}")
    return engine
