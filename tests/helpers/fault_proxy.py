"""An HTTP proxy in front of the moto S3 server that injects faults: 5xx answers, connection
resets, and requests that are read but never answered. Tests choose the fault of each request
with a policy ``(method, path, n) -> None | "500" | "503" | "reset" | "hang"``, where ``n``
counts the requests seen so far (from 0)."""
from __future__ import annotations

import http.client
import http.server
import socket
import struct
import threading
from typing import Callable, Optional
from urllib.parse import urlsplit

Policy = Callable[[str, str, int], Optional[str]]

_S3_ERRORS = {"500": ("InternalError", "We encountered an internal error."),
              "503": ("SlowDown", "Please reduce your request rate.")}


class FaultProxy:
    """``url`` is the proxy's endpoint; ``faults`` counts the faults injected, per kind."""

    def __init__(self, upstream: str) -> None:
        up = urlsplit(upstream)
        self.upstream = (up.hostname, up.port)
        self.policy: Policy = lambda method, path, n: None
        self.requests: list[tuple[str, str, Optional[str]]] = []
        self.faults: dict[str, int] = {}
        self.release = threading.Event()  # set at stop: "hang" requests give up then
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    n = len(proxy.requests)
                    fault = proxy.policy(self.command, self.path, n)
                    proxy.requests.append((self.command, self.path, fault))
                    if fault:
                        proxy.faults[fault] = proxy.faults.get(fault, 0) + 1
                if fault == "hang":
                    proxy.release.wait()
                    self.close_connection = True
                    return
                if fault == "reset":
                    # SO_LINGER 0: close() sends RST instead of FIN
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault in _S3_ERRORS:
                    code, message = _S3_ERRORS[fault]
                    self._answer(int(fault), {"Content-Type": "application/xml"},
                                 f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode())
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                    conn.request(self.command, self.path, body=body if length else None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    headers = {k: v for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
                    if self.command != "HEAD":  # a HEAD answer's length is the object's, not its (empty) body's
                        headers.pop("Content-Length", None)
                        headers.pop("content-length", None)
                    self._answer(resp.status, headers, data)
                finally:
                    conn.close()

            def _answer(self, status: int, headers: dict, body: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if not any(k.lower() == "content-length" for k in headers):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def set(self, policy: Policy) -> None:
        with self._lock:
            self.policy = policy

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
