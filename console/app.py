"""The console's web application: Starlette, server-rendered Jinja2 pages, no script.

Pages (GET): ``/`` overview, ``/workers``, ``/items`` (search) and ``/items/{id}``,
``/dlq``, ``/gaps``, ``/federation``; ``/login``. Actions (POST, admin role, CSRF
token): ``/confirm`` shows what an action will do, ``/apply`` does it after the
confirmation and logs ``console_action`` with who (token name or ``local``) and
the remote address. See docs/console.md.

Authentication: with no token configured every visitor on the loopback address
is ``local`` with the admin role (the CLI would let them do the same with
admin.toml); with tokens, a visitor signs in at ``/login`` (a session cookie:
HttpOnly, SameSite=Strict) or sends ``Authorization: Bearer TOKEN``. Tokens are
compared in constant time.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import structlog
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ccsq.brokerd import gaps
from ccsq.brokerd.gap_report import inline_code_html
from ccsq.common.wire.errors import AdminFailed, BrokerUnavailable, CcsqError
from ccsq.console import charts
from ccsq.console.data import Source

log = structlog.get_logger("ccsq.console")

ROLES = ("viewer", "admin")
COOKIE = "ccsq_console"
MAX_SESSIONS = 10_000
DLQ_LISTED = 200
#: Keys a worker's status entry may carry about its claim store (added by the store-health
#: work): the workers page shows an "unhealthy store" column when any peer has one.
STORE_HEALTH_KEYS = ("store_unhealthy", "unhealthy_store", "store_healthy", "store_error")
#: status keys the pages show in their own places; any other key is listed under "more".
KNOWN_STATUS_KEYS = frozenset({
    "source", "ledger_id", "epoch", "counters", "states", "balanced", "backlog", "gaps", "oldest_ready_created_ms",
    "oldest_ready_age_s", "dead", "dead_listed", "draining", "broker", "peers", "rejects", "send", "ledger",
    "leases_in_memory", "in_flight_deliveries", "federation", "federation_links", "links",
    "readers", "ha",
})

#: An item record's wall-clock fields (ms) as the item page's history names them.
TIME_LABELS = {"created_ms": "submitted", "nb_ms": "ready not before", "lease_expires_ms": "lease expires",
               "completed_ms": "completed", "acked_ms": "acknowledged", "ended_ms": "ended (dead/expired)",
               "deadline_ms": "deadline"}

def item_times(rec: dict) -> dict[str, int]:
    """The item page's history: {label: epoch ms} of the record's wall-clock fields that are
    set. ``lease expires`` only while the item is leased: the field stays in the record after
    the lease ends (a dead item would show an expiry in the future)."""
    return {TIME_LABELS.get(k, k.removesuffix("_ms")): v for k, v in rec.items()
            if k.endswith("_ms") and isinstance(v, int) and v > 10**11
            and (k != "lease_expires_ms" or rec.get("state") == "leased")}


ACTIONS: dict[str, dict[str, str]] = {
    "dlq_replay": {"verb": "Replay", "back": "/dlq",
                   "what": "The dead item becomes ready again with a fresh attempt budget (gap event G10)."},
    "dlq_purge": {"verb": "Purge", "back": "/dlq",
                  "what": "The dead item is deleted and its idempotency key freed (gap event G11). This cannot be undone."},
    "drain": {"verb": "Drain", "back": "/workers",
              "what": "The broker stops dispatching to this worker; its leases finish. Kept in the ledger (survives restarts)."},
    "undrain": {"verb": "Resume", "back": "/workers", "what": "The broker dispatches to this worker again."},
    "items_cancel": {"verb": "Cancel", "back": "/items/{target}",
                     "what": "The ready item becomes dead with reason cancelled (gap event G7): it leaves the queue, the "
                             "dead letters list it and a replay brings it back. A leased or finished item is left as it is."},
}


def _back(spec: dict[str, str], target: str) -> str:
    """Where an action's confirm page goes back to and its apply redirects (an item's page for a cancel)."""
    import urllib.parse

    return spec["back"].replace("{target}", urllib.parse.quote(target, safe=""))


@dataclass(frozen=True)
class Token:
    """One console token: ``name`` (logged as who), ``secret``, ``role`` (viewer | admin)."""

    name: str
    secret: str
    role: str


@dataclass
class Viewer:
    name: str
    role: str
    csrf: str = ""
    bearer: bool = False
    flash: list[str] = field(default_factory=list)

    @property
    def admin(self) -> bool:
        return self.role == "admin"


class Auth:
    """Tokens and the sessions signed in with them (in memory: a restart signs everyone out)."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = list(tokens)
        self.sessions: OrderedDict[str, Viewer] = OrderedDict()

    @property
    def required(self) -> bool:
        return bool(self.tokens)

    def match(self, presented: str) -> Token | None:
        """The token equal to ``presented`` (constant-time compare against every token), or None."""
        found = None
        given = presented.encode()
        for t in self.tokens:
            if hmac.compare_digest(given, t.secret.encode()) and found is None:
                found = t
        return found

    def open(self, name: str, role: str) -> tuple[str, Viewer]:
        sid = secrets.token_urlsafe(32)
        viewer = Viewer(name, role, csrf=secrets.token_urlsafe(32))
        self.sessions[sid] = viewer
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return sid, viewer


class LocalHostOnly:
    """ASGI middleware for a console without tokens: answer only requests whose Host
    names the loopback address (a DNS-rebinding page on another name gets 403)."""

    def __init__(self, app: Any, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            name = host if host.endswith("]") else host.rsplit(":", 1)[0]
            if name.strip("[]").lower() not in self.hosts:
                resp = PlainTextResponse(f"this console answers only to {', '.join(sorted(self.hosts))} "
                                         "(it has no token: a guard against DNS rebinding)\n", status_code=403)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _remote(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (bytes, bytearray)):
        return f"{len(v)} bytes"
    return "" if v is None else str(v)


class Console:
    """The application: ``Console(source, auth, refresh_s).app`` is the ASGI app."""

    def __init__(self, source: Source, auth: Auth, *, refresh_s: float = 5.0, local_hosts: frozenset[str] = frozenset()) -> None:
        self.source = source
        self.auth = auth
        self.refresh_s = refresh_s
        self.local_hosts = local_hosts
        self.env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"),
                               autoescape=select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(ms=charts.fmt_ms, dur=charts.fmt_s, val=_fmt_value, md=lambda t: Markup(inline_code_html(t)))
        routes = [
            Route("/", self.overview), Route("/workers", self.workers), Route("/items", self.items),
            Route("/items/{item_id:path}", self.item), Route("/dlq", self.dlq), Route("/gaps", self.gap_register),
            Route("/federation", self.federation), Route("/login", self.login, methods=["GET", "POST"]),
            Route("/logout", self.logout, methods=["POST"]), Route("/confirm", self.confirm, methods=["POST"]),
            Route("/apply", self.apply, methods=["POST"]), Route("/healthz", self.healthz),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)
        if local_hosts and not auth.required:
            self.app.add_middleware(LocalHostOnly, hosts=local_hosts)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            self.source.close()

    # --- plumbing ---
    def _who(self, request: Request) -> tuple[Viewer | None, str | None]:
        """(viewer or None, a new session id to set as cookie or None)."""
        sid = request.cookies.get(COOKIE)
        if sid and (v := self.auth.sessions.get(sid)) is not None:
            return v, None
        authz = request.headers.get("authorization", "")
        if authz[:7].lower() == "bearer ":
            t = self.auth.match(authz[7:].strip())
            if t is not None:
                return Viewer(t.name, t.role, bearer=True), None
        if self.auth.required:
            return None, None
        new_sid, v = self.auth.open("local", "admin")
        return v, new_sid

    def _page(self, request: Request, template: str, ctx: dict[str, Any], viewer: Viewer, new_sid: str | None,
              *, status_code: int = 200, refresh: bool = False) -> Response:
        flash, viewer.flash = viewer.flash, []
        body = self.env.get_template(template).render(
            request=request, viewer=viewer, flash=flash, path=request.url.path,
            refresh_s=int(self.refresh_s) if refresh and self.refresh_s > 0 else 0,
            now=time.strftime("%Y-%m-%d %H:%M:%S"), **ctx,
        )
        return self._finish(HTMLResponse(body, status_code=status_code), new_sid)

    @staticmethod
    def _finish(resp: Response, new_sid: str | None) -> Response:
        if new_sid:
            resp.set_cookie(COOKIE, new_sid, httponly=True, samesite="strict", path="/")
        resp.headers["Content-Security-Policy"] = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                                   "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "same-origin"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    def _login_redirect(self, request: Request) -> Response:
        """Browsers go to /login; a client that sent ``Authorization`` (a script with a
        wrong or unknown token) gets 401 with ``WWW-Authenticate: Bearer`` (RFC 6750)."""
        if request.headers.get("authorization") is not None:
            log.warning("console_bearer_refused", remote=_remote(request))
            resp = PlainTextResponse("unknown or malformed bearer token\n", status_code=401, headers={
                "WWW-Authenticate": 'Bearer realm="ccsq console", error="invalid_token"'})
            return self._finish(resp, None)
        nxt = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return self._finish(RedirectResponse(f"/login?next={quote(nxt)}", status_code=303), None)

    async def _status(self) -> tuple[dict[str, Any] | None, str]:
        try:
            return await self.source.read("status"), ""
        except CcsqError as exc:
            return None, f"neither the broker nor the ledger answered: {self.source.broker_error}; {exc}"

    def _error(self, request: Request, viewer: Viewer, new_sid: str | None, message: str, status_code: int) -> Response:
        return self._page(request, "error.html", {"title": "error", "message": message, "status": None}, viewer, new_sid,
                          status_code=status_code)

    # --- pages ---
    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def overview(self, request: Request) -> Response:
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        status, why = await self._status()
        report, report_err = await self.source.report()
        ctx: dict[str, Any] = {"title": "overview", "status": status, "status_error": why or self.source.broker_error,
                               "report_error": report_err}
        if status is None and report is not None:  # no broker and no admin path: the report still has the ledger's numbers
            status = {"source": "ledger (offline)", "counters": report["counters"], "states": report["states"],
                      "balanced": report["balanced"], "backlog": report["backlog"],
                      "gaps": {w["id"]: w["count"] for w in report["windows"]},
                      "peers": [], "draining": []}
            ctx["status"] = status
        if status is None:
            return self._page(request, "error.html", {**ctx, "message": why}, viewer, new_sid, status_code=503, refresh=True)
        if report is not None:
            now_ms = report["generated_ms"]
            pts = charts.rate_points(report["series"], report["counters"], now_ms)
            ctx["chart"] = Markup(charts.rate_chart_svg(pts, now_ms))
            ctx["rates"], ctx["rates_since_ms"] = charts.hour_rates(report["series"], report["counters"], now_ms)
            ctx["samples"] = len(pts)
            ctx["queues"] = report["queues"]
        else:
            ctx["queues"] = [{"kind": k, "ready": v.get("ready", 0), "leased": v.get("leased", 0),
                              "backlog": v.get("ready", 0) + v.get("leased", 0), "completed_per_s": None, "drain_eta_s": None,
                              "deadline_in_s": None, "verdict": "-"} for k, v in sorted(status.get("backlog", {}).items())]
        ctx["more"] = {k: v for k, v in status.items() if k not in KNOWN_STATUS_KEYS}
        from ccsq.tools.admin_cmds import ha_lines  # a broker pair (docs/ha.md): primary, epoch, standbys' lag

        ctx["ha_lines"] = ha_lines(status.get("ha"))
        return self._page(request, "overview.html", ctx, viewer, new_sid, refresh=True)

    async def workers(self, request: Request) -> Response:
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        status, why = await self._status()
        if status is None:
            return self._error(request, viewer, new_sid, why, 503)
        peers = sorted(status.get("peers", []), key=lambda s: (s.get("role") != "worker", s.get("peer_id", "")))
        store_key = next((k for k in STORE_HEALTH_KEYS if any(k in s for s in peers)), None)
        connected = {s.get("peer_id") for s in peers}
        ctx = {"title": "workers", "status": status, "peers": peers, "store_key": store_key, "me": self.source.settings.peer_id,
               "drained_away": [w for w in status.get("draining", []) if w not in connected]}
        return self._page(request, "workers.html", ctx, viewer, new_sid, refresh=True)

    async def items(self, request: Request) -> Response:
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        q = request.query_params.get("q", "").strip()
        ctx: dict[str, Any] = {"title": "items", "q": q, "status": None, "not_found": ""}
        if q:
            try:
                await self.source.read("items_show", {"item_id": q})
                return self._finish(RedirectResponse(f"/items/{quote(q, safe='')}", status_code=303), new_sid)
            except AdminFailed:
                pass
            except CcsqError as exc:
                return self._error(request, viewer, new_sid, str(exc), 503)
            item_id = await self.source.find_key(q)
            if item_id:
                return self._finish(RedirectResponse(f"/items/{quote(item_id, safe='')}", status_code=303), new_sid)
            ctx["not_found"] = q
        else:  # no search: the newest items, by state and kind
            from ccsq.brokerd.ledger.schema import STATES

            state = request.query_params.get("state", "").strip()
            kind = request.query_params.get("kind", "").strip()
            state = state if state in STATES else ""
            found, read, why = await self.source.recent_items(state, kind)
            ctx.update(states=STATES, state=state, kind=kind, recent=found, recent_read=read, recent_error=why)
        return self._page(request, "items.html", ctx, viewer, new_sid, status_code=404 if q else 200)

    async def item(self, request: Request) -> Response:
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        item_id = request.path_params["item_id"]
        try:
            doc = await self.source.read("items_show", {"item_id": item_id})
        except AdminFailed as exc:
            return self._page(request, "items.html", {"title": "items", "q": item_id, "not_found": item_id, "detail": str(exc),
                                                      "status": None}, viewer, new_sid, status_code=404)
        except CcsqError as exc:
            return self._error(request, viewer, new_sid, str(exc), 503)
        extras = await self.source.item_extras(item_id)
        rec = doc["item"]
        time_keys = {k for k, v in rec.items() if k.endswith("_ms") and isinstance(v, int) and v > 10**11}
        times = item_times(rec)
        fields = {k: v for k, v in rec.items() if k not in time_keys and k not in ("params",)}
        default_attempts = None
        if not rec.get("max_attempts"):  # 0: the broker's max_attempts, as `ccsq items show` says
            from ccsq.tools.admin_cmds import broker_max_attempts

            default_attempts = broker_max_attempts(self.source.settings.config_path)
            fields["max_attempts"] = f"broker default ({default_attempts})" if default_attempts else "broker default"
        ctx = {"title": f"item {item_id}", "status": {"source": doc.get("source")}, "rec": rec, "times": times,
               "lease": doc.get("lease_in_memory"), "extras": extras, "fields": fields,
               "default_attempts": default_attempts}
        return self._page(request, "item.html", ctx, viewer, new_sid)

    async def dlq(self, request: Request) -> Response:
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        try:
            doc = await self.source.read("dlq_list", {"limit": DLQ_LISTED})
        except CcsqError as exc:
            return self._error(request, viewer, new_sid, str(exc), 503)
        ctx = {"title": "dead letters", "doc": doc, "status": {"source": doc.get("source")}}
        return self._page(request, "dlq.html", ctx, viewer, new_sid)

    async def gap_register(self, request: Request) -> Response:
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        windows, rejects, report_err = await self.source.gap_windows()
        status = None
        if windows is None:
            status, why = await self._status()
            if status is None:
                return self._error(request, viewer, new_sid, f"{why}; {report_err}", 503)
            counts = status.get("gaps", {})
            windows = [{"id": w.id, "name": w.name, "where": w.where, "why": w.why, "repair": w.repair,
                        "count": counts.get(w.id, 0), "recent": []} for w in gaps.WINDOWS]
        ctx = {"title": "gap register", "windows": windows, "report_error": report_err,
               "status": status or {"source": "ledger snapshot"}, "rejects": rejects}
        return self._page(request, "gaps.html", ctx, viewer, new_sid, refresh=True)

    async def federation(self, request: Request) -> Response:
        """Links as this broker sees them: its relay peers (side, link, credit, leases) and,
        when a swarm refused a link, since when, why and the fix (the relay's heartbeat)."""
        viewer, new_sid = self._who(request)
        if viewer is None:
            return self._login_redirect(request)
        status, why = await self._status()
        links: list[dict] = []
        if status is not None:
            fed = status.get("federation_links") or status.get("links") or status.get("federation") or []
            if isinstance(fed, dict):
                fed = fed.get("links", [])
            links = [x for x in fed if isinstance(x, dict)]
            if not links:
                links = relay_links(status.get("peers") or [])
        columns: list[str] = []
        for link in links:
            columns += [k for k in link if k not in columns]
        ctx = {"title": "federation", "status": status, "status_error": why, "links": links, "columns": columns}
        return self._page(request, "federation.html", ctx, viewer, new_sid, refresh=True)

    # --- sign in ---
    async def login(self, request: Request) -> Response:
        nxt = request.query_params.get("next", "/")
        if not nxt.startswith("/") or nxt.startswith("//") or "\\" in nxt:
            nxt = "/"
        anon = Viewer("", "")
        if request.method == "GET":
            return self._page(request, "login.html", {"title": "sign in", "next": nxt, "status": None, "failed": False}, anon, None)
        form = await request.form()
        t = self.auth.match(str(form.get("token", "")))
        if t is None:
            log.warning("console_login_refused", remote=_remote(request))
            return self._page(request, "login.html", {"title": "sign in", "next": nxt, "status": None, "failed": True}, anon, None,
                              status_code=401)
        sid, _viewer = self.auth.open(t.name, t.role)
        log.info("console_login", who=t.name, role=t.role, remote=_remote(request))
        return self._finish(RedirectResponse(nxt, status_code=303), sid)

    async def logout(self, request: Request) -> Response:
        sid = request.cookies.get(COOKIE)
        if sid:
            self.auth.sessions.pop(sid, None)
        resp = RedirectResponse("/login" if self.auth.required else "/", status_code=303)
        resp.delete_cookie(COOKIE, path="/")
        return self._finish(resp, None)

    # --- actions: confirm, then apply ---
    async def _action_form(self, request: Request) -> tuple[Viewer | None, str | None, dict[str, str], Response | None]:
        viewer, new_sid = self._who(request)
        if viewer is None:
            if request.headers.get("authorization") is not None:
                return None, None, {}, self._login_redirect(request)  # 401 + WWW-Authenticate
            return None, None, {}, self._finish(PlainTextResponse("sign in first (/login)\n", status_code=401), None)
        form = {k: str(v) for k, v in (await request.form()).items()}
        origin = request.headers.get("origin")
        if origin and origin != "null" and origin.split("://", 1)[-1] != request.headers.get("host", ""):
            return viewer, new_sid, form, self._error(request, viewer, new_sid, f"cross-site request from {origin} refused", 403)
        if not viewer.bearer and (not viewer.csrf or not hmac.compare_digest(form.get("csrf", "").encode(), viewer.csrf.encode())):
            log.warning("console_csrf_refused", who=viewer.name, remote=_remote(request), action=form.get("action"))
            return viewer, new_sid, form, self._error(request, viewer, new_sid,
                                                      "the form is stale or not from this console (CSRF token); reload the page", 403)
        if not viewer.admin:
            log.warning("console_action_refused", who=viewer.name, role=viewer.role, remote=_remote(request), action=form.get("action"))
            return viewer, new_sid, form, self._error(request, viewer, new_sid, f"{viewer.name} has role {viewer.role}; "
                                                      "changing state needs the admin role", 403)
        if form.get("action") not in ACTIONS or not form.get("target"):
            return viewer, new_sid, form, self._error(request, viewer, new_sid, "unknown action or no target", 400)
        if form["action"] == "items_cancel" and form["target"] == "*":  # one item at a time here; the CLI takes a kind
            return viewer, new_sid, form, self._error(request, viewer, new_sid, "cancel takes one item (`ccsq items cancel --kind` "
                                                      "takes a kind)", 400)
        return viewer, new_sid, form, None

    async def confirm(self, request: Request) -> Response:
        viewer, new_sid, form, refused = await self._action_form(request)
        if refused is not None:
            return refused
        assert viewer is not None
        action, target = form["action"], form["target"]
        detail = None
        if (action.startswith("dlq_") or action == "items_cancel") and target != "*":
            try:
                detail = (await self.source.read("items_show", {"item_id": target}))["item"]
            except CcsqError:
                detail = None
        ctx = {"title": "confirm", "action": action, "target": target, "spec": ACTIONS[action], "detail": detail,
               "status": None, "back": _back(ACTIONS[action], target)}
        return self._page(request, "confirm.html", ctx, viewer, new_sid)

    async def apply(self, request: Request) -> Response:
        viewer, new_sid, form, refused = await self._action_form(request)
        if refused is not None:
            return refused
        assert viewer is not None
        action, target = form["action"], form["target"]
        spec = ACTIONS[action]
        if form.get("confirm") != "yes":
            return self._error(request, viewer, new_sid, "not confirmed: use the confirm page", 400)

        async def go(session) -> dict[str, Any]:
            if action in ("drain", "undrain"):
                return await session.call("drain", {"worker": target, "undo": action == "undrain"})
            if action == "items_cancel":
                return await session.call("items_cancel", {"item_ids": target})
            key = "replayed" if action == "dlq_replay" else "purged"
            done: list[str] = []
            not_dead: list[str] = []
            if target == "*":
                while True:
                    doc = await session.call(action, {"all": True})
                    done += doc[key]
                    if not doc["more"] or not doc[key]:
                        break
            else:
                doc = await session.call(action, {"item_id": target})
                done += doc[key]
                not_dead += doc["not_dead"]
            return {key: done, "not_dead": not_dead}

        who, remote = viewer.name, _remote(request)
        try:
            out = await self.source.broker(go)
        except BrokerUnavailable as exc:
            log.warning("console_action_failed", who=who, remote=remote, action=action, target=target, error=str(exc))
            return self._error(request, viewer, new_sid, f"{spec['verb']} needs the running broker (only it writes the ledger): {exc}", 503)
        except AdminFailed as exc:
            log.warning("console_action_failed", who=who, remote=remote, action=action, target=target, error=str(exc))
            return self._error(request, viewer, new_sid, f"the broker refused: {exc}", 409)
        log.info("console_action", who=who, role=viewer.role, remote=remote, action=action, target=target, result=out)
        if action in ("drain", "undrain"):
            msg = f"{target}: {'draining' if out['draining'] else 'dispatching again'}; {out['leases']} lease(s) held"
        elif action == "items_cancel":
            msg = (f"{target}: cancelled (dead, reason cancelled)" if out["cancelled"] else
                   f"{target}: not cancelled: unknown item" if out["unknown"] else
                   f"{target}: not cancelled: not ready (state {out['not_ready'].get(target, '?')}), left as it is")
        else:
            key = "replayed" if action == "dlq_replay" else "purged"
            msg = f"{key} {len(out[key])} item(s)" + (f": {', '.join(out[key][:10])}" if out[key] else "")
            if out["not_dead"]:
                msg += f"; not dead: {', '.join(out['not_dead'])}"
        viewer.flash.append(msg)
        return self._finish(RedirectResponse(_back(spec, target), status_code=303), new_sid)


def relay_links(peers: list) -> list[dict]:
    """One row per relay session in ``ccsq status`` peers (docs/federation.md, "A refused
    or broken link"): ``broken`` is the reason, empty while the link works."""
    import time as _time

    rows = []
    for peer in peers:
        if not isinstance(peer, dict) or peer.get("role") != "relay":
            continue
        info = peer.get("info") or {}
        since = info.get("link_broken_since")
        rows.append({"peer": peer.get("peer_id", ""), "link": info.get("link", ""), "side": info.get("relay_side", ""),
                     "kinds": ", ".join(peer.get("kinds") or []), "credit": peer.get("credit", 0),
                     "leases": peer.get("leases", 0), "healthy": "yes" if peer.get("healthy") else "NO",
                     "broken": info.get("link_broken", ""),
                     "broken since": _time.strftime("%Y-%m-%d %H:%M:%S UTC", _time.gmtime(since)) if since else "",
                     "fix": info.get("link_broken_fix", "")})
    return rows
