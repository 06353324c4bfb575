"""The console's HTTP face: ``/console/`` on the sink's admin port, behind the admin token.

Guarantees:

* nothing under ``/console/`` but the login form and the static files is served without
  a session (a page redirects to the login form, a fragment or an action answers
  401/403); a session begins only with the admin token given to the login form
  (compared in constant time, :mod:`sinks.console.auth`) and lives in a cookie that is
  ``HttpOnly``, ``SameSite=Strict``, ``Path=/console`` (``Secure`` over HTTPS);
* every action (a ``POST``) carries the session's CSRF token, as the form field
  ``csrf`` or the header ``X-CSRF-Token``: without it, or with another, 403 and nothing
  done (without a session, or with a wrong header, before the body is read); a wrong
  token at the login form is answered after :data:`LOGIN_REFUSAL_DELAY_S`;
* an action does what the admin API or the CLI does, through the same objects
  (:class:`~sinks.console.sources.ConsoleSources`): a retry is the admin API's retry, a
  discard ``outbox-cdc failed accept`` with a reason, an audit ``outbox-cdc audit``
  (``--repair`` only after a confirmation page);
* requests are bounded like the admin API's: the header section by
  :func:`sinks.http.guard.headers_too_large` (431), a body by
  :data:`MAX_FORM_BYTES` (413, refused on its declared length before it is read);
* no log line carries the token, a cookie or a CSRF token; every answer is
  ``Cache-Control: no-store`` with a Content-Security-Policy that allows the console's
  own script and styles only.

:func:`with_console` puts the console in front of the admin app (whose bearer guard it
leaves untouched): the sink's server wires it with one line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cdc.health import Liveness
from cdc.settings import Settings
from sinks.console import auth, layout, lot_pages, pages
from sinks.console.sources import AuditBusy, ConsoleSources
from sinks.console.views import FilterError, ids_of, parked_filter, sort_partitions
from sinks.http.guard import MAX_HEADER_BYTES, MAX_HEADER_COUNT, headers_too_large
from sinks.parking.lot import ParkingLot
from sinks.parking.retrier import Retrier, retry_message

log = logging.getLogger("sinks.console")

PREFIX = layout.PREFIX
#: The session cookie's name.
COOKIE = "outbox_console"
#: Largest form an action takes (a selection of 100 ids and a reason is ~2 KiB).
MAX_FORM_BYTES = 64 * 1024
#: Most fields a form may have (a selection of every row of a page, and a few more).
MAX_FORM_FIELDS = 300
#: Longest reason written with a discard (the lot keeps 500 characters of it).
MAX_REASON_CHARS = 500
#: A wrong token is answered this late: guessing it one request after another is slow.
LOGIN_REFUSAL_DELAY_S = 0.5
#: The header an action sent by fetch carries its CSRF token in.
CSRF_HEADER = "x-csrf-token"
STATIC_DIR = Path(__file__).parent / "static"
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
        " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
}
_SECURITY_RAW = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

Handler = Callable[[Request, str], Awaitable[Response]]


class Console:
    """The console's routes over its sources and the admin token."""

    def __init__(self, sources: ConsoleSources, *, token: str) -> None:
        self.sources = sources
        self._token = token
        self._key = auth.session_key(token)

    # ----------------------------------------------------------- sessions
    def session(self, request: Request) -> str | None:
        cookie = request.cookies.get(COOKIE)
        return cookie if auth.session_valid(self._key, cookie, now_s=time.time()) else None

    def csrf(self, cookie: str) -> str:
        return auth.csrf_token(self._key, cookie)

    def page(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A GET page: the login form without a session."""

        async def endpoint(request: Request) -> Response:
            cookie = self.session(request)
            if cookie is None:
                if request.query_params.get("fragment"):
                    return Response(status_code=401)
                return RedirectResponse(f"{PREFIX}/login", status_code=303)
            return await handler(request, cookie)

        return endpoint

    def action(
        self, handler: Callable[[Request, str, dict[str, list[str]]], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """A POST action: a session and its CSRF token, or 403 and nothing done."""

        async def endpoint(request: Request) -> Response:
            cookie = self.session(request)
            header = request.headers.get(CSRF_HEADER)
            if cookie is None or (header is not None and not self._csrf_ok(cookie, header)):
                return _refused(request)  # (before one byte of the body is read)
            form = await read_form(request)
            if form is None:
                return Response("form too large or malformed", status_code=413)
            if header is None and not self._csrf_ok(cookie, (form.get("csrf") or [""])[0]):
                return _refused(request)
            return await handler(request, cookie, form)

        return endpoint

    def _csrf_ok(self, cookie: str, given: str) -> bool:
        return auth.csrf_valid(self._key, cookie, given)

    # -------------------------------------------------------------- login
    async def login_form(self, request: Request) -> Response:
        if not self._key:
            return HTMLResponse(layout.login_page(disabled=True), status_code=503)
        if self.session(request) is not None:
            return RedirectResponse(f"{PREFIX}/", status_code=303)
        return HTMLResponse(layout.login_page())

    async def login(self, request: Request) -> Response:
        if not self._key:
            return HTMLResponse(layout.login_page(disabled=True), status_code=503)
        form = await read_form(request)
        given = (form or {}).get("token", [""])[0]
        if not auth.token_matches(given, self._token):
            log.info("console login refused from %s", _client(request))
            await asyncio.sleep(LOGIN_REFUSAL_DELAY_S)
            return HTMLResponse(
                layout.login_page(error="That is not the admin token."), status_code=401
            )
        cookie = auth.issue_session(self._key, now_s=time.time())
        log.info("console login from %s", _client(request))
        answer = RedirectResponse(f"{PREFIX}/", status_code=303)
        answer.set_cookie(
            COOKIE,
            cookie,
            max_age=auth.SESSION_MAX_AGE_S,
            path=PREFIX,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return answer

    async def logout(self, _: Request, __: str, ___: dict[str, list[str]]) -> Response:
        answer = RedirectResponse(f"{PREFIX}/login", status_code=303)
        answer.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return answer

    # -------------------------------------------------------------- pages
    async def overview(self, request: Request, cookie: str) -> Response:
        data = await self.sources.overview()
        if request.query_params.get("fragment"):
            return HTMLResponse(pages.overview_fragment(data))
        return HTMLResponse(pages.overview_page(data, csrf=self.csrf(cookie)))

    async def lag(self, request: Request, cookie: str) -> Response:
        readout = await self.sources.lag()
        asked = request.query_params.get("sort")
        descending = request.query_params.get("dir", "desc") != "asc"
        rows, key = sort_partitions(
            readout.value.partitions if readout.value else (), asked, descending
        )
        descending = descending or key != asked  # an unknown key: by lag, most first
        return HTMLResponse(
            pages.lag_page(
                readout.value,
                readout.error,
                rows,
                sort=key,
                descending=descending,
                history=self.sources.history,
                csrf=self.csrf(cookie),
            )
        )

    async def parking(self, request: Request, cookie: str, status: str = "") -> Response:
        params = dict(request.query_params)
        try:
            f = parked_filter(params)
        except FilterError as exc:
            f = parked_filter({})
            return HTMLResponse(
                lot_pages.parking_page(None, str(exc), f, csrf=self.csrf(cookie)), status_code=400
            )
        readout = await self.sources.parked(f)
        return HTMLResponse(
            lot_pages.parking_page(
                readout.value, readout.error, f, csrf=self.csrf(cookie), status=status
            )
        )

    async def parked_detail(self, request: Request, cookie: str, status: str = "") -> Response:
        event_id = int(request.path_params["event_id"])
        readout = await self.sources.parked_row(event_id)
        if readout.value is None:
            return HTMLResponse(
                layout.message_page(
                    "Parked row",
                    readout.error or "not found",
                    csrf=self.csrf(cookie),
                    path="/parking",
                ),
                status_code=404,
            )
        return HTMLResponse(
            lot_pages.parked_detail_page(readout.value, csrf=self.csrf(cookie), status=status)
        )

    async def trace(self, request: Request, cookie: str) -> Response:
        params = dict(request.query_params)
        event_id = params.get("id", "").strip()[:100]
        key = params.get("key", "").strip()[:200]
        if not event_id and not key:
            return HTMLResponse(lot_pages.trace_page(None, None, params, csrf=self.csrf(cookie)))
        readout = await self.sources.trace(event_id=event_id or None, key=key or None)
        code = 200 if readout.value is not None else 404
        return HTMLResponse(
            lot_pages.trace_page(readout.value, readout.error, params, csrf=self.csrf(cookie)),
            status_code=code,
        )

    async def audit(self, _: Request, cookie: str, status: str = "") -> Response:
        data = await self.sources.relay_audit()
        return HTMLResponse(
            pages.audit_page(data, self.sources.last_audit, csrf=self.csrf(cookie), status=status)
        )

    # ------------------------------------------------------------ actions
    async def retry(self, request: Request, cookie: str, form: dict[str, list[str]]) -> Response:
        try:
            ids = ids_of(form.get("id", []))
        except FilterError as exc:
            return await self._after(request, cookie, form, str(exc), code=400)
        if not ids:
            return await self._after(request, cookie, form, "select rows to retry", code=400)
        summary = await self.sources.retry(ids)
        log.info("console retry of %s: %s", ids[:20], summary.as_data())
        message = retry_message(
            summary.unknown_ids, summary.busy_ids, untried_ids=summary.untried_ids
        )
        return await self._after(request, cookie, form, lot_pages.retry_status(summary, message))

    async def discard(self, request: Request, cookie: str, form: dict[str, list[str]]) -> Response:
        try:
            ids = ids_of(form.get("id", []))
        except FilterError as exc:
            return await self._after(request, cookie, form, str(exc), code=400)
        reason = (form.get("reason") or [""])[0].strip()[:MAX_REASON_CHARS]
        if not ids or not reason:
            text = "select rows and give a reason to discard them"
            return await self._after(request, cookie, form, text, code=400)
        done = await self.sources.discard(ids, reason)
        log.info("console discard of %s (reason %r): %d marked DONE", ids[:20], reason, len(done))
        left = sorted(set(ids) - set(done))
        text = f"discarded {len(done)} row(s) (marked DONE unsent)" + (
            f"; not open or being retried: {left[:20]}" if left else ""
        )
        return await self._after(request, cookie, form, layout.esc(text))

    async def _after(
        self,
        request: Request,
        cookie: str,
        form: dict[str, list[str]],
        status: str,
        *,
        code: int = 200,
    ) -> Response:
        """The page an action came from, with its outcome as the status line."""
        ids = form.get("id", [])
        if (form.get("back") or [""])[0] == "detail" and len(ids) == 1 and ids[0].isdigit():
            request.path_params["event_id"] = ids[0]
            answer = await self.parked_detail(request, cookie, status=status)
        else:
            answer = await self.parking(request, cookie, status=status)
        if code != 200:
            answer.status_code = code
        return answer

    async def run_audit(
        self, request: Request, cookie: str, form: dict[str, list[str]]
    ) -> Response:
        since = (form.get("since") or [""])[0].strip()[:100]
        repair = (form.get("repair") or [""])[0] == "on"
        if repair and (form.get("confirm") or [""])[0] != "yes":
            return HTMLResponse(pages.confirm_repair_page(since, csrf=self.csrf(cookie)))
        try:
            readout = await self.sources.run_audit(repair=repair, since=since or None)
        except AuditBusy as exc:
            return await self._audit_after(request, cookie, str(exc), 409)
        if readout.value is None:
            return await self._audit_after(request, cookie, f"audit failed: {readout.error}", 200)
        verdict = readout.value["verdict"]
        return await self._audit_after(
            request, cookie, f"audit {readout.value['run_id']}: {verdict}", 200
        )

    async def _audit_after(self, request: Request, cookie: str, text: str, code: int) -> Response:
        answer = await self.audit(request, cookie, status=layout.esc(text))
        answer.status_code = code
        return answer

    # ------------------------------------------------------------- routes
    def routes(self) -> list[Route | Mount]:
        return [
            Route("/", self.page(self.overview)),
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.action(self.logout), methods=["POST"]),
            Route("/lag", self.page(self.lag)),
            Route("/parking", self.page(self.parking)),
            Route("/parking/{event_id:int}", self.page(self.parked_detail)),
            Route("/parking/retry", self.action(self.retry), methods=["POST"]),
            Route("/parking/discard", self.action(self.discard), methods=["POST"]),
            Route("/trace", self.page(self.trace)),
            Route("/audit", self.page(self.audit)),
            Route("/audit/run", self.action(self.run_audit), methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]


async def read_form(request: Request) -> dict[str, list[str]] | None:
    """The urlencoded form of a request, read up to :data:`MAX_FORM_BYTES` (None past it,
    or with more than :data:`MAX_FORM_FIELDS` fields)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    try:
        return parse_qs(body.decode("utf-8", "replace"), max_num_fields=MAX_FORM_FIELDS)
    except ValueError:
        return None


def _refused(request: Request) -> Response:
    """403: no session, or not its CSRF token; nothing done."""
    log.info("console action refused: %r (no session or CSRF token)", request.url.path[:100])
    return HTMLResponse(
        layout.message_page(
            "Refused",
            "This action needs a session and its CSRF token: reload the page.",
            csrf=None,
            path="/login",
        ),
        status_code=403,
    )


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


class ConsoleGuard:
    """ASGI middleware: header bounds, the body limit, the security headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        target = (scope.get("raw_path") or b"") + scope["query_string"]
        if headers_too_large(target, headers):
            text = (
                f"header section larger than {MAX_HEADER_BYTES} bytes or {MAX_HEADER_COUNT} fields"
            )
            await Response(text, status_code=431)(scope, receive, send)
            return
        declared = next(
            (int(v) for k, v in headers if k == b"content-length" and v.strip().isdigit()), 0
        )
        if declared > MAX_FORM_BYTES:
            await Response("form too large", status_code=413)(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = [*message.get("headers", []), *_SECURITY_RAW]
                message = {**message, "headers": raw}
            await send(message)

        await self.app(scope, receive, send_secured)


def create_console(sources: ConsoleSources, *, token: str) -> ASGIApp:
    """The console as an ASGI app serving ``/console/...``."""
    console = Console(sources, token=token)
    app = Starlette(routes=[Mount(PREFIX, routes=console.routes())])
    return ConsoleGuard(app)


def with_console(admin: ASGIApp, console: ASGIApp) -> ASGIApp:
    """``/console`` and below to the console, everything else to the admin app."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and (path == PREFIX or path.startswith(PREFIX + "/")):
            await console(scope, receive, send)
        else:
            await admin(scope, receive, send)

    return app


def mount_console(
    admin: ASGIApp,
    *,
    settings: Settings,
    lot: ParkingLot,
    retrier: Retrier,
    registry: CollectorRegistry,
    liveness: Liveness,
) -> ASGIApp:
    """The sink's HTTP app with the console at ``/console/`` (the one line the sink adds)."""
    sources = ConsoleSources(
        settings=settings, lot=lot, retrier=retrier, registry=registry, liveness=liveness
    )
    token = settings.admin_api_token.get_secret_value()
    return with_console(admin, create_console(sources, token=token))
