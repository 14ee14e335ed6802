"""The supervisor's health checks: one kept-alive HTTP client per server process, against a real server."""

from __future__ import annotations

import sys

from lightning.serving import free_port
from lightning.stack import ServerProcess

# A /health server that prints a line per TCP connection, so the test can count them in the process's log.
HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()
        print("connection", flush=True)
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_health_checks_reuse_one_client_per_process(tmp_path):
    port = free_port()
    log = tmp_path / "health.log"
    child = ServerProcess(
        "health server", [sys.executable, "-c", HEALTH_SERVER, str(port)], {}, f"http://127.0.0.1:{port}", log, 30.0
    )
    child.start()
    try:
        client = child.client
        assert client is not None
        for _ in range(5):
            assert child.healthy()
        assert child.client is client
        assert log.read_text().count("connection") == 1  # start's check and the five after it: one connection

        child.restart()  # a new process, a new client; the old one is closed with its process
        assert client.is_closed
        assert child.healthy() and child.client is not client
    finally:
        child.stop()
    assert child.client is None
