"""cdc.healthcheck: the image's one healthcheck finds the role of PID 1 and asks it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from cdc import healthcheck
from cdc.settings import Settings

ENTRYPOINT = ["/usr/bin/python3", "/usr/local/bin/outbox-cdc"]


def test_the_ports_default_to_the_settings_defaults() -> None:
    defaults = Settings()
    assert healthcheck.PROBES["relay"].default_port == defaults.relay_http_port
    assert healthcheck.PROBES["sink"].default_port == defaults.sink_http_port
    assert healthcheck.PROBES["engine-stub"].default_port == defaults.engine_stub_port


@pytest.mark.parametrize(
    ("argv", "env", "url"),
    [
        ([*ENTRYPOINT, "relay"], {}, "http://127.0.0.1:9101/readyz"),
        ([*ENTRYPOINT, "relay"], {"CDC_RELAY_HTTP_PORT": "7001"}, "http://127.0.0.1:7001/readyz"),
        ([*ENTRYPOINT, "sink"], {"SINK_HTTP_PORT": "7002"}, "http://127.0.0.1:7002/readyz"),
        (
            [*ENTRYPOINT, "engine-stub", "--host", "0.0.0.0"],
            {},
            "http://127.0.0.1:8081/_stub/stats",
        ),
        ([*ENTRYPOINT, "engine-stub", "--port", "7003"], {}, "http://127.0.0.1:7003/_stub/stats"),
        ([*ENTRYPOINT, "engine-stub", "--port=7004"], {}, "http://127.0.0.1:7004/_stub/stats"),
        ([*ENTRYPOINT, "migrate"], {}, None),
        ([*ENTRYPOINT, "lag"], {}, None),
        ([], {}, None),
    ],
)
def test_the_url_is_the_roles(argv: list[str], env: dict[str, str], url: str | None) -> None:
    assert healthcheck.url_for(argv, env) == url


class _Answer(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"not streaming" if self.status != 200 else b"ok")

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[HTTPServer]:
    httpd = HTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_a_200_is_healthy_anything_else_is_not(server: HTTPServer) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}/readyz"
    assert healthcheck.check(url)[0] == healthcheck.HEALTHY
    _Answer.status = 503
    try:
        code, line = healthcheck.check(url)
    finally:
        _Answer.status = 200
    assert code == healthcheck.UNHEALTHY
    assert "503" in line
    assert "not streaming" in line


def test_nothing_listening_is_unhealthy_with_the_reason(server: HTTPServer) -> None:
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    code, line = healthcheck.check(f"http://127.0.0.1:{port}/readyz")
    assert code == healthcheck.UNHEALTHY
    assert str(port) in line


def test_main_reads_the_role_from_pid_1(
    server: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join(s.encode() for s in [*ENTRYPOINT, "sink"]) + b"\0")
    monkeypatch.setattr(healthcheck, "MAIN_CMDLINE", cmdline)
    monkeypatch.setenv("SINK_HTTP_PORT", str(server.server_address[1]))
    assert healthcheck.main() == healthcheck.HEALTHY
    monkeypatch.setenv("SINK_HTTP_PORT", "not-a-port")
    assert healthcheck.main() == healthcheck.UNHEALTHY
    cmdline.write_bytes(b"\0".join(s.encode() for s in [*ENTRYPOINT, "migrate"]) + b"\0")
    assert healthcheck.main() == healthcheck.HEALTHY
