"""A command's first contact with Kafka names what refused it (cdc.kafka.client).

librdkafka's reasons below are the texts it gave against a real TLS-only broker
(tests/integration/test_tls_services.py runs them end to end); here the pure parts:
the reason kept by :class:`KafkaClientEvents`, its explanation with the setting to fix,
and :func:`speaks_tls` against loopback servers (one speaking TLS, one not).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from cdc.kafka.client import diagnose, explain, speaks_tls
from cdc.kafka.log import KafkaClientEvents
from tests.pki import make_pki

#: What librdkafka 2.x reported, and the KAFKA_CONFIG_* variable the line must name.
REFUSALS = {
    "the broker's CA not trusted": (
        "ssl://127.0.0.1:43727/bootstrap: SSL handshake failed: error:0A000086:SSL routines::"
        "certificate verify failed: broker certificate could not be verified, verify that"
        " ssl.ca.location is correctly configured or root CA certificates are installed"
        " (install ca-certificates package) (after 394ms in state SSL_HANDSHAKE)",
        "KAFKA_CONFIG_SSL_CA_LOCATION",
    ),
    "no client certificate": (
        "ssl://127.0.0.1:44629/bootstrap: Receive failed: error:0A000412:SSL routines::ssl/tls"
        " alert bad certificate: SSL alert number 42 (after 3ms in state APIVERSION_QUERY)",
        "KAFKA_CONFIG_SSL_CERTIFICATE_LOCATION",
    ),
    "SASL credentials refused": (
        "sasl_ssl://127.0.0.1:59547/bootstrap: SASL authentication error: Authentication failed"
        " during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512"
        " (after 33ms in state AUTH_REQ)",
        "KAFKA_CONFIG_SASL_PASSWORD",
    ),
    "TLS at a plaintext listener (librdkafka's guess)": (
        "ssl://127.0.0.1:26892/bootstrap: SSL handshake failed: Disconnected: SSL connection"
        " closed by peer: connecting to a PLAINTEXT broker listener? (after 2ms in state"
        " SSL_HANDSHAKE)",
        "KAFKA_CONFIG_SECURITY_PROTOCOL",
    ),
    "TLS at a plaintext listener (no guess)": (
        "ssl://127.0.0.1:26892/bootstrap: Disconnected: SSL connection closed by peer"
        " (after 2ms in state SSL_HANDSHAKE)",
        "KAFKA_CONFIG_SECURITY_PROTOCOL",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_known_refusal_is_explained_with_the_setting_to_fix(case: str) -> None:
    text, variable = REFUSALS[case]
    explained = explain(text)
    assert explained is not None and variable in explained
    # trimmed: no broker prefix, no timing, no OpenSSL code, not librdkafka's own advice
    assert "bootstrap" not in explained and "after " not in explained
    assert "error:0A" not in explained and "ca-certificates package" not in explained


def test_a_broker_that_was_down_is_not_a_refusal() -> None:
    """A stale "connection refused" must not explain a broker that accepts connections now."""
    text = (
        "127.0.0.1:26892/bootstrap: Connect to ipv4#127.0.0.1:26892 failed: Connection refused"
        " (after 0ms in state CONNECT)"
    )
    assert explain(text) is None


def test_the_cause_is_the_latest_error_that_says_why_not_all_brokers_down() -> None:
    events = KafkaClientEvents("ops")
    with events.held():
        events.on_error(KafkaError(KafkaError._SSL, "handshake failed"))
        events.on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert events.cause == ("_SSL", "handshake failed")
    assert events.last_error == ("_ALL_BROKERS_DOWN", "1/1 brokers are down")


def _serve(server: socket.socket, context: ssl.SSLContext | None) -> None:
    """Accept one connection; handshake (TLS) or answer nothing (plaintext); close."""
    conn, _ = server.accept()
    with conn:
        if context is None:
            conn.recv(1024)
            return
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError):
            pass


@pytest.fixture(params=["tls", "plaintext"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, int]]:
    context = None
    if request.param == "tls":
        pki = make_pki(tmp_path)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.server_cert, pki.server_key)
    server = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=_serve, args=(server, context), daemon=True)
    thread.start()
    yield request.param, server.getsockname()[1]
    server.close()
    thread.join(10)


def test_a_tls_handshake_tells_a_tls_listener_from_a_plaintext_one(
    listener: tuple[str, int],
) -> None:
    kind, port = listener
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert speaks_tls(sock) is (kind == "tls")


def test_a_plaintext_client_at_a_tls_listener_is_told_to_set_the_security_protocol(
    listener: tuple[str, int],
) -> None:
    kind, port = listener
    found = diagnose(f"127.0.0.1:{port}", "Broker transport failure")
    if kind == "tls":
        assert "is a TLS listener and the client speaks plaintext" in found
        assert "KAFKA_CONFIG_SECURITY_PROTOCOL=SSL" in found
    else:
        assert "accepts connections but Kafka did not answer" in found


def test_a_tls_client_is_not_told_to_speak_tls() -> None:
    """A client already on TLS with no known refusal gets the generic line (no TLS probe)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        found = diagnose(f"127.0.0.1:{port}", "Broker transport failure", security_protocol="SSL")
    assert "accepts connections but Kafka did not answer" in found


def test_a_refusal_is_named_once_the_broker_accepts_the_connection() -> None:
    text, _ = REFUSALS["SASL credentials refused"]
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        found = diagnose(
            f"127.0.0.1:{port}",
            "Broker transport failure",
            cause=("_AUTHENTICATION", text),
            security_protocol="SASL_SSL",
        )
    assert found.startswith(f"127.0.0.1:{port} accepts connections but not this client: SASL")
