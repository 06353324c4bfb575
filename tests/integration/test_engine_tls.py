"""The engine client over real TLS, mTLS and an HTTP proxy, against the real engine stub.

A private CA, a server and a client certificate are generated per module
(:mod:`tests.pki`); the stub serves them with uvicorn in a thread; the proxy
is a real CONNECT/forwarding proxy on loopback (:mod:`tests.proxy`).
Configuration mistakes must come back as :class:`EngineMisconfigured` with a
reason naming the setting, and nothing may be applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.errors import ConfigError
from cdc.settings import Settings
from sinks.core.errors import EngineMisconfigured, EngineUnavailable
from sinks.engine import http1
from sinks.engine.client import TLS_UNVERIFIED_WARNING, EngineClient, EngineTLS
from sinks.shared.routes import user_sync_call
from sinks.stub.server import StubServer, StubTLS
from tests.pki import Pki, make_pki
from tests.proxy import ProxyServer

API_KEY = "tls-test-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("other-pki"), name="other")


@pytest.fixture
def tls_stub(pki: Pki) -> Iterator[StubServer]:
    tls = StubTLS(certfile=str(pki.server_cert), keyfile=str(pki.server_key))
    with StubServer(api_key=API_KEY, tls=tls, control_ssl=pki.client_context()) as stub:
        yield stub


@pytest.fixture
def mtls_stub(pki: Pki) -> Iterator[StubServer]:
    tls = StubTLS(
        certfile=str(pki.server_cert), keyfile=str(pki.server_key), client_ca=str(pki.ca_cert)
    )
    with StubServer(api_key=API_KEY, tls=tls, control_ssl=pki.client_context()) as stub:
        yield stub


def _client_tls(pki: Pki, *, client: Pki | None = None) -> EngineTLS:
    return EngineTLS(
        ca_file=str(pki.ca_cert),
        client_cert=str(client.client_cert) if client else "",
        client_key=str(client.client_key) if client else "",
    )


def _send(url: str, event_id: str, **kwargs: object) -> None:
    async def go() -> None:
        async with EngineClient(base_url=url, api_key=API_KEY, **kwargs) as client:  # type: ignore[arg-type]
            await client.send(user_sync_call(f"user-{event_id}"), event_id=event_id)

    asyncio.run(go())


def _misconfigured(url: str, **kwargs: object) -> EngineMisconfigured:
    with pytest.raises(EngineMisconfigured) as info:
        _send(url, "never-applied", **kwargs)
    error = info.value
    assert isinstance(error, EngineUnavailable)  # the sink pauses and probes
    assert not error.spends_attempt
    return error


def _applied_ids(stub: StubServer) -> set[str]:
    return {item["event_id"] for item in stub.applied()["items"]}


def test_https_with_the_private_ca_delivers(tls_stub: StubServer, pki: Pki) -> None:
    assert tls_stub.url.startswith("https://")
    _send(tls_stub.url, "e-tls", tls=_client_tls(pki))
    assert _applied_ids(tls_stub) == {"e-tls"}


def test_untrusted_certificate_is_misconfiguration_naming_engine_ca_file(
    tls_stub: StubServer, other_pki: Pki
) -> None:
    error = _misconfigured(tls_stub.url, tls=_client_tls(other_pki))
    assert "certificate verify failed" in error.reason
    assert "ENGINE_CA_FILE" in error.reason
    assert isinstance(error.__cause__, http1.TLSError)
    assert _applied_ids(tls_stub) == set()


def test_certificate_for_another_host_is_misconfiguration_naming_the_base_url(
    tmp_path: Path,
) -> None:
    misnamed = make_pki(tmp_path / "misnamed", server_names=("engine.elsewhere.test",))
    tls = StubTLS(certfile=str(misnamed.server_cert), keyfile=str(misnamed.server_key))
    control = misnamed.client_context()
    control.check_hostname = False
    with StubServer(api_key=API_KEY, tls=tls, control_ssl=control) as stub:
        error = _misconfigured(stub.url, tls=EngineTLS(ca_file=str(misnamed.ca_cert)))
        assert "mismatch" in error.reason
        assert "ENGINE_BASE_URL" in error.reason
        assert _applied_ids(stub) == set()


def test_system_trust_store_does_not_trust_the_private_ca(tls_stub: StubServer) -> None:
    error = _misconfigured(tls_stub.url)
    assert "ENGINE_CA_FILE" in error.reason


def test_mtls_with_the_client_certificate_delivers(mtls_stub: StubServer, pki: Pki) -> None:
    _send(mtls_stub.url, "e-mtls", tls=_client_tls(pki, client=pki))
    assert _applied_ids(mtls_stub) == {"e-mtls"}


def test_mtls_without_a_client_certificate_is_misconfiguration(
    mtls_stub: StubServer, pki: Pki
) -> None:
    error = _misconfigured(mtls_stub.url, tls=_client_tls(pki))
    assert "ENGINE_CLIENT_CERT" in error.reason
    assert _applied_ids(mtls_stub) == set()


def test_mtls_with_a_certificate_of_another_ca_is_misconfiguration(
    mtls_stub: StubServer, pki: Pki, other_pki: Pki
) -> None:
    error = _misconfigured(mtls_stub.url, tls=_client_tls(pki, client=other_pki))
    assert "ENGINE_CLIENT_CERT" in error.reason
    assert _applied_ids(mtls_stub) == set()


def test_https_to_a_plain_http_port_is_misconfiguration(pki: Pki) -> None:
    with StubServer(api_key=API_KEY) as plain:
        error = _misconfigured(plain.url.replace("http://", "https://"), tls=_client_tls(pki))
        assert "ENGINE_BASE_URL" in error.reason
        assert plain.stats()["requests"] == 0


def test_verification_off_delivers_with_a_loud_warning(
    tls_stub: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sinks.engine")
    _send(tls_stub.url, "e-unverified", tls=EngineTLS(verify=False))
    assert _applied_ids(tls_stub) == {"e-unverified"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [TLS_UNVERIFIED_WARNING]


def test_redirect_is_misconfiguration_naming_the_target(tls_stub: StubServer, pki: Pki) -> None:
    tls_stub.add_faults(
        {"status": 308, "times": 1, "headers": {"Location": "https://engine.example/api"}}
    )
    error = _misconfigured(tls_stub.url, tls=_client_tls(pki))
    assert "https://engine.example/api" in error.reason
    assert "ENGINE_BASE_URL" in error.reason
    assert error.status == 308


def test_unreadable_tls_files_are_config_errors_naming_the_variable(
    tmp_path: Path, pki: Pki
) -> None:
    with pytest.raises(ConfigError, match="ENGINE_CA_FILE"):
        EngineClient(base_url="https://e", tls=EngineTLS(ca_file=str(tmp_path / "absent.pem")))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match="ENGINE_CA_FILE"):
        EngineClient(base_url="https://e", tls=EngineTLS(ca_file=str(garbage)))
    with pytest.raises(ConfigError, match="ENGINE_CLIENT_CERT") as info:
        EngineClient(
            base_url="https://e",
            tls=EngineTLS(client_cert=str(pki.client_cert), client_key=str(pki.server_cert)),
        )
    assert "BEGIN" not in str(info.value)
    with pytest.raises(ConfigError, match="together"):
        EngineClient(base_url="https://e", tls=EngineTLS(client_cert=str(pki.client_cert)))


def test_from_settings_reads_the_tls_variables(mtls_stub: StubServer, pki: Pki) -> None:
    settings = Settings.from_env(
        {
            "ENGINE_BASE_URL": mtls_stub.url,
            "INTERNAL_API_KEY": API_KEY,
            "ENGINE_CA_FILE": str(pki.ca_cert),
            "ENGINE_CLIENT_CERT": str(pki.client_cert),
            "ENGINE_CLIENT_KEY": str(pki.client_key),
        }
    )

    async def go() -> None:
        async with EngineClient.from_settings(settings) as client:
            await client.sync_user("u-settings", event_id="e-settings")

    asyncio.run(go())
    assert _applied_ids(mtls_stub) == {"e-settings"}


def test_https_engine_through_a_connect_proxy_with_credentials(
    mtls_stub: StubServer, pki: Pki
) -> None:
    with ProxyServer(credentials="puser:p@ss") as proxy:
        settings = Settings.from_env(
            {
                "ENGINE_BASE_URL": mtls_stub.url,
                "INTERNAL_API_KEY": API_KEY,
                "ENGINE_CA_FILE": str(pki.ca_cert),
                "ENGINE_CLIENT_CERT": str(pki.client_cert),
                "ENGINE_CLIENT_KEY": str(pki.client_key),
                "https_proxy": f"http://puser:p%40ss@127.0.0.1:{proxy.port}",
            }
        )

        async def go() -> None:
            async with EngineClient.from_settings(settings) as client:
                await client.sync_user("u-proxied", event_id="e-proxied")

        asyncio.run(go())
        assert [(s.method, s.target) for s in proxy.seen] == [
            ("CONNECT", f"127.0.0.1:{mtls_stub.port}")
        ]
    assert _applied_ids(mtls_stub) == {"e-proxied"}


def test_proxy_refusing_our_credentials_is_misconfiguration(tls_stub: StubServer, pki: Pki) -> None:
    with ProxyServer(credentials="puser:right") as proxy:
        error = _misconfigured(
            tls_stub.url,
            tls=_client_tls(pki),
            proxy=f"http://puser:wrong@127.0.0.1:{proxy.port}",
        )
    assert "407" in error.reason
    assert "wrong" not in error.reason
    assert _applied_ids(tls_stub) == set()


def test_no_proxy_bypasses_the_proxy(tls_stub: StubServer, pki: Pki) -> None:
    with ProxyServer() as proxy:
        settings = Settings.from_env(
            {
                "ENGINE_BASE_URL": tls_stub.url,
                "INTERNAL_API_KEY": API_KEY,
                "ENGINE_CA_FILE": str(pki.ca_cert),
                "HTTPS_PROXY": proxy.url,
                "NO_PROXY": "localhost,127.0.0.1",
            }
        )

        async def go() -> None:
            async with EngineClient.from_settings(settings) as client:
                await client.sync_user("u-direct", event_id="e-direct")

        asyncio.run(go())
        assert proxy.seen == []
    assert _applied_ids(tls_stub) == {"e-direct"}


def test_plain_http_engine_through_a_forwarding_proxy_with_extra_headers() -> None:
    with StubServer(api_key=API_KEY) as stub, ProxyServer(credentials="u:pw") as proxy:

        async def go() -> None:
            async with EngineClient(base_url=stub.url, api_key=API_KEY, proxy=proxy.url) as client:
                await client.send(
                    user_sync_call("u-fwd"),
                    event_id="e-fwd",
                    headers={
                        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                    },
                )

        asyncio.run(go())
        (seen,) = proxy.seen
        assert (seen.method, seen.target) == ("POST", f"{stub.url}/api/internal/users/sync")
        head = seen.head.decode("latin-1").lower()
        assert "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" in head
        assert "idempotency-key: e-fwd" in head
        assert _applied_ids(stub) == {"e-fwd"}
