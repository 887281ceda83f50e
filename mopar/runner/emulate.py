"""A threaded HTTP server on 127.0.0.1, in a thread of the runner's process: what the runner's
stand-ins for a platform's parts answer on. No torch.

The platforms' own parts are their targets' (``mopar/targets/<target>/emulate.py``: OpenFaaS's
gateway queue and a client's callback URL, Lambda's Invoke API around one handler).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["JSON", "LoopbackServer"]


JSON = {"Content-Type": "application/json"}


class LoopbackServer:
    """A threaded HTTP server on a free 127.0.0.1 port, in a thread of this process: each POST
    is answered with what ``handle(path, headers, body)`` returns, (status, body, headers)."""

    def __init__(
        self, handle: Callable[[str, dict[str, str], bytes], tuple[int, bytes, dict[str, str]]]
    ):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, data, extra = handle(self.path, headers, body)
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
