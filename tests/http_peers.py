"""Tiny loopback HTTP servers that misbehave on purpose, for the model server's error paths, the stream llama.cpp's
server would send, and a proxy that records what the app sends to a real server (and can change it on the way)."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from app.protocols.base import encode


def llama_stream(tokenizer, text: str, stop: str) -> bytes:
    """llama.cpp's stream of `text`, ended by the stop string `stop` (which its `content` leaves out)."""
    ids = encode(tokenizer, text + stop)
    events = [{"content": text, "tokens": ids, "stop": False, "tokens_predicted": len(ids)},
              {"content": "", "tokens": [], "stop": True, "stop_type": "word", "stopping_word": stop,
               "tokens_predicted": len(ids), "timings": {"prompt_n": 5, "cache_n": 0}}]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()


def serve(body: bytes | Callable[[dict], tuple[int, bytes]], status: int = 200, hold: threading.Event | None = None,
          requests: list | None = None):
    """A loopback HTTP server answering every POST with `body` (or with `body(request)`'s status and bytes, by
    the JSON request), then, with `hold`, keeping the connection open (stalled, nothing more sent) until `hold` is
    set. `requests`: each POST's JSON body is appended to it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if requests is not None:
                requests.append(json.loads(data))
            code, answer = body(json.loads(data)) if callable(body) else (status, body)
            self.send_response(code)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(answer)
            self.wfile.flush()
            if hold is not None:
                hold.wait()

        def log_message(self, *args):
            pass

    return _start(Handler)


def serve_get(routes: dict[str, tuple[int, object]]):
    """A loopback HTTP server answering GETs of `routes`' paths with (status, JSON); any other path: 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code, answer = routes.get(self.path, (404, {"error": "not found"}))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(answer).encode())

        def log_message(self, *args):
            pass

    return _start(Handler)


def proxy(upstream: str, change: Callable[[str, dict], dict] | None = None):
    """A loopback HTTP proxy in front of `upstream` (a real model server): it forwards every request, streams
    every answer back as it comes, and records each POST as (path, JSON body) in `httpd.requests`, the body as
    the app sent it; `change(path, body)` returns the body to forward instead (e.g. a broken grammar)."""
    target = urlsplit(upstream)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self._forward(None)

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            httpd.requests.append((self.path, body))
            self._forward(change(self.path, body) if change is not None else body)

        def _forward(self, body: dict | None):
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
            try:
                data = None if body is None else json.dumps(body).encode()
                conn.request(self.command, self.path, body=data,
                             headers={"Content-Type": "application/json"} if data is not None else {})
                answer = conn.getresponse()
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.getheader("Content-Type", "application/json"))
                self.end_headers()  # (HTTP/1.0: the answer ends when the connection closes)
                while chunk := answer.read1(1 << 16):
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except OSError:  # the app closed its side (Stop): closing ours stops the upstream too
                pass
            finally:
                conn.close()

        def log_message(self, *args):
            pass

    httpd, url = _start(Handler)
    httpd.requests = []
    return httpd, url


def _start(handler):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
