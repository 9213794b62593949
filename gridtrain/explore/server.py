"""`gridtrain explore`: the explorer's web server, Python's own threaded HTTP server on loopback.

GET serves the page and its scripts from the package (nothing from the network) and the read-only
API (the cards, the runs); POST /api/... takes a JSON body of at most MAX_BODY bytes. Whatever a
client sends, it gets JSON with a status: 400 for a body that is not the JSON asked for, 404 for an
unknown path, 405 for another method, 413 for a body too large, 422 for inputs the planner refuses;
a handler's own failure is a 500 with one line, and the server keeps serving.

Only this machine's pages may use it (DNS rebinding, cross-site forms): every request must carry a
Host header naming the server, that is `localhost`, `127.0.0.1`, `[::1]`, the address it is bound
to or the --host name it was started with, each with the server's port or without; any other Host
is a 421, whatever the method or path. An Origin header, when a request has one, must be the
page's own, `http://<one of those names>:<port>`, else 403; a POST must say `Content-Type:
application/json`, else 415 (a cross-site form or a text/plain fetch cannot). So with --host
0.0.0.0 the page answers to http://0.0.0.0:<port>/ and the loopback names only: to reach it from
another machine, start it with --host set to the address or name that machine will use.

Plan searches are CPU-bound Python and share one interpreter lock: at most PLAN_SLOTS run at once,
the other requests sleep in line (their 10 s search budget starts when their search does), so a
burst of them neither starves the page's GETs nor runs every search out of time. A search whose
client has hung up (the page aborts a request that newer input superseded) stops at its next core,
or before it starts if it was still in line (plan/stop.py), and answers nothing. A client that
hangs up is no error; another error is one line on stderr.
"""

from __future__ import annotations

import contextlib
import json
import mimetypes
import select
import socket
import sys
import threading
import time
import webbrowser
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlsplit

from gridtrain.explore import api, cards, runs

STATIC = Path(__file__).parent / "static"
MAX_BODY = 64 * 1024
"""Bytes a request body may have: a plan request is under 1 KiB."""
PLAN_SLOTS = 2
"""How many plan searches run at once; other plan requests wait in line, asleep. Each search more
shares the interpreter lock with the page's GETs (50 at once: GETs took seconds and most searches
ran out of budget); two rather than one so that one long search does not hold up every short one."""
LISTEN_BACKLOG = 128
"""Connections the kernel holds before the server accepts them (Python's default of 5 dropped or
reset connections of a page's burst)."""
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


class Handler(BaseHTTPRequestHandler):
    server_version = "gridtrain-explore"
    runs_dir: Path | None = None
    quiet = True
    timeout = 30
    """Seconds a connection may sit idle or send a body slower than this (then it is closed)."""

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unknown method) as JSON too."""
        self.close_connection = True
        try:
            self._json(code, {"error": message or explain or f"HTTP {code}"})
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: object) -> None:
        self._send(status, json.dumps(data, allow_nan=False, default=str).encode(), "application/json")

    def parse_request(self) -> bool:
        """http.server's own parsing, then the checks of the module docstring: False once refused."""
        if not super().parse_request():
            return False
        refusal = self.server.refusal(self.command, self.headers)
        if refusal is None:
            return True
        self.close_connection = True
        self._json(*refusal)
        return False

    def _guarded(self, answer: Callable[[], tuple[int, object]],
                 slots: threading.Semaphore | None = None) -> None:
        try:
            with slots or contextlib.nullcontext():
                status, data = answer()
            if status == 499:  # nobody awaits it (api.plan): no answer to send
                self.close_connection = True
                self.server.cancelled += 1
                return
        except Exception as e:  # a bug of ours: one line to the client, the server goes on
            status, data = 500, {"error": f"internal error: {type(e).__name__}: {e}"[:500]}
        try:
            self._json(status, data)
        except ValueError:  # a NaN or infinity in the answer
            self._json(500, {"error": "internal error: the answer held a number JSON cannot carry"})

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path.startswith("/api/"):
            self._guarded(lambda: self._get_api(path))
            return
        name = "index.html" if path == "/" else path.removeprefix("/static/") if path.startswith("/static/") else ""
        try:
            target = (STATIC / name).resolve()
            found = bool(name) and STATIC.resolve() in target.parents and target.is_file()
        except (ValueError, OSError):  # a NUL byte, a name too long
            found = False
        if not found:
            self._json(404, {"error": f"no page at {path[:200]}"})
            return
        kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        self._send(200, target.read_bytes(), f"{kind}; charset=utf-8" if kind.startswith("text/") or
                   kind.endswith("javascript") else kind)

    do_HEAD = do_GET

    def _get_api(self, path: str) -> tuple[int, object]:
        if path == "/api/options":
            return 200, api.options()
        if path == "/api/cards":
            return 200, cards.card_list()
        if path == "/api/runs":
            return runs.run_list(self.runs_dir)
        if path.startswith("/api/runs/"):
            return runs.run_page(self.runs_dir, path.removeprefix("/api/runs/"))
        return 404, {"error": f"no API at GET {path[:200]}"}

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        route = api.ROUTES.get(path) or (cards.answer_route(path) if path.startswith("/api/cards/") else None)
        if route is None:
            self._json(404 if path.startswith("/api/") else 405, {"error": f"no API at POST {path[:200]}"})
            return
        lengths = self.headers.get_all("Content-Length") or ["0"]
        if len(lengths) > 1 or not lengths[0].strip().isdigit():
            self.close_connection = True
            self._json(400, {"error": "Content-Length must be given once, as a whole number of bytes"})
            return
        length = int(lengths[0])
        if length > MAX_BODY:
            self.close_connection = True
            self._json(413, {"error": f"the body has {length:,} bytes; at most {MAX_BODY:,}"})
            return
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            self._json(408, {"error": f"the body did not arrive within {self.timeout} s"})
            return
        if len(raw) < length:
            self.close_connection = True
            self._json(400, {"error": f"the body ended after {len(raw):,} of {length:,} bytes"})
            return
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            self._json(400, {"error": f"the body is not JSON this server reads: {type(e).__name__}"})
            return
        if path in api.ROUTES:
            self._guarded(lambda: route(body, cancelled=self._client_gone), self.server.plan_slots)
        else:
            self._guarded(lambda: route(body))

    def _client_gone(self) -> bool:
        """True once the client has closed its end: nothing awaits the answer (a request body has
        been read whole, so the socket is readable only at its end or with a pipelined request)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _refuse(self) -> None:
        self._json(405, {"error": f"{self.command} is not served: use GET or POST"})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse


def _bracketed(name: str) -> str:
    """A host name or address as a Host header writes it (an IPv6 address in brackets), lower case."""
    name = name.strip().lower()
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


SWITCH_INTERVAL_S = 0.001
"""The interpreter's thread switch interval while a server is open (ExploreServer.__init__)."""


class ExploreServer(ThreadingHTTPServer):
    """The threaded HTTP server with a listen backlog for a page's burst, a line of plan slots, the
    Host and Origin rules of the module docstring, and no traceback for a client that hung up."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, host: str, port: int, handler: type[Handler]) -> None:
        super().__init__((host, port), handler)
        port = self.server_address[1]
        names = {*LOOPBACK_NAMES, _bracketed(self.server_address[0]), _bracketed(host)} - {""}
        self.allowed_hosts = frozenset(names | {f"{name}:{port}" for name in names})
        self.allowed_origins = frozenset(f"http://{name}" for name in self.allowed_hosts
                                         if name.endswith(f":{port}") or port == 80)
        self.plan_slots = threading.BoundedSemaphore(PLAN_SLOTS)
        self.cancelled = 0
        """Plan requests dropped because their client had hung up."""
        # Two searches run in Python beside the threads that accept and answer: each of those waits
        # for the interpreter lock at every step, up to the switch interval (5 ms by default) a time,
        # and a burst of 50 connections took a GET past a second. 1 ms keeps them in pace; the
        # interval is the process's, so it is given back on close.
        self.switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self.switch_interval, SWITCH_INTERVAL_S))

    def server_close(self) -> None:
        super().server_close()
        sys.setswitchinterval(self.switch_interval)

    def refusal(self, method: str, headers: Message) -> tuple[int, dict] | None:
        """The answer to a request these rules refuse (status, JSON), or None to serve it."""
        port = self.server_address[1]
        hosts = headers.get_all("Host") or []
        if len(hosts) != 1 or hosts[0].strip().lower() not in self.allowed_hosts:
            shown = ", ".join(repr(h[:100]) for h in hosts) or "none"
            names = ", ".join(sorted(name for name in self.allowed_hosts if not name.endswith(f":{port}")))
            return 421, {"error": f"Host {shown} is not a name of this server: it answers to {names} "
                                  f"(port {port}); to serve another, start it with --host set to that name"}
        origins = headers.get_all("Origin") or []
        if origins and (len(origins) > 1 or origins[0].strip().lower() not in self.allowed_origins):
            return 403, {"error": f"Origin {origins[0][:100]!r} is not this server's page"}
        content_type = (headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if method == "POST" and content_type != "application/json":
            return 415, {"error": f"a POST body must be sent as Content-Type: application/json, not "
                                  f"{content_type[:100] or 'none'}"}
        return None

    def handle_error(self, request: object, client_address: tuple) -> None:
        """A client that hung up is no error; anything else is one line on stderr, not a traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            return
        text = " ".join(str(error).split())
        print(f"gridtrain explore: serving {client_address[0]}: {type(error).__name__}: {text}"[:500],
              file=sys.stderr, flush=True)


def make_server(host: str = "127.0.0.1", port: int = 0, runs_dir: Path | None = None,
                timeout: float = Handler.timeout) -> ExploreServer:
    """A server bound to host:port (port 0: a free one), not yet serving."""
    handler = type("BoundHandler", (Handler,), {"runs_dir": runs_dir, "timeout": timeout})
    return ExploreServer(host, port, handler)


def serve(host: str, port: int, runs_dir: Path | None, open_browser: bool) -> int:
    """The command: serve until interrupted, printing the URL first."""
    start = time.perf_counter()
    try:
        server = make_server(host, port, runs_dir)
    except OSError as e:
        print(f"gridtrain explore: cannot listen on {host}:{port}: {e.strerror or e}; choose another --port",
              file=sys.stderr)
        return 2
    url = f"http://{host}:{server.server_address[1]}/"
    print(f"gridtrain explore: serving {url} (ready in {time.perf_counter() - start:.2f} s; Ctrl-C stops it)",
          flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: listening on {host}, not only this machine's loopback; the page answers to Host "
              f"{_bracketed(host)}, localhost and 127.0.0.1 only", flush=True)
    # Warm the planner's caches (layer costs, activation bytes) while the user opens the page.
    threading.Thread(target=api.plan, args=(api.PRESETS_TRY[0]["state"] | {"layout": {}},), daemon=True).start()
    if open_browser:
        threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

