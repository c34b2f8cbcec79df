"""Tiny loopback HTTP servers that misbehave on purpose, for the model server's error paths."""

from __future__ import annotations

import http.server
import threading


def serve(body: bytes, status: int = 200, hold: threading.Event | None = None):
    """A loopback HTTP server answering every POST with `body`, then, with `hold`, keeping the connection open
    (stalled, nothing more sent) until `hold` is set."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            if hold is not None:
                hold.wait()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
