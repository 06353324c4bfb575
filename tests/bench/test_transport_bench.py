"""The engine client's transport, decided by measurement: sinks.engine.http1 vs aiohttp (vs httpx).

Each client sends the same requests (``users/sync``, compact JSON, the same
headers, a fresh Idempotency-Key each) to the engine stub running in its own
process, 64 in flight, over plain HTTP, TLS and mTLS (a private CA and client
certificate generated for the run). The clients take turns within one run and
each combination is measured :data:`ROUNDS` times (the best round is kept, the
machine being shared), so the figures are side by side under the same load;
``uptime`` is printed with them.

Figures: client CPU per request (this process's CPU time / requests: only
the client runs here) and requests/s (wall clock; the stub's own CPU caps it).
Only correctness is asserted: every request was applied.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from sinks.core.statuses import classify
from sinks.engine.client import API_KEY_HEADER, IDEMPOTENCY_HEADER, EngineClient, EngineTLS
from sinks.shared.routes import EngineCall, user_sync_call
from tests.bench.conftest import API_KEY, StubProc, start_stub
from tests.bench.report import fmt, print_table
from tests.pki import Pki, make_pki

pytestmark = [pytest.mark.bench]

CONCURRENCY = 64
REQUESTS = {"http1": 4_000, "aiohttp": 4_000, "httpx": 1_000}
ROUNDS = 3

Send = Callable[[EngineCall, str], Awaitable[None]]


class AiohttpEngine:
    """The engine client's request path on aiohttp: same headers, body and classification."""

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None) -> None:
        connector = aiohttp.TCPConnector(
            limit=CONCURRENCY, ssl=ssl_context if ssl_context is not None else True
        )
        self._base_url = base_url
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers={"content-type": "application/json", API_KEY_HEADER: API_KEY},
            timeout=aiohttp.ClientTimeout(sock_connect=2, sock_read=3),
            auto_decompress=False,
        )

    async def send(self, call: EngineCall, event_id: str) -> None:
        content = json.dumps(call.body, separators=(",", ":"), allow_nan=False).encode()
        async with self._session.post(
            self._base_url + call.path,
            data=content,
            headers={IDEMPOTENCY_HEADER: event_id},
            allow_redirects=False,
        ) as response:
            body = await response.read()
        error = classify(response.status, body, response.headers).error(user_id=call.user_id)
        if error is not None:
            raise error

    async def aclose(self) -> None:
        await self._session.close()


@dataclass(frozen=True)
class Figure:
    scheme: str
    client: str
    requests: int
    cpu_us_per_request: float
    requests_per_s: float


async def _drive(send: Send, requests: int) -> tuple[float, float]:
    """``requests`` sends, CONCURRENCY at a time: (process CPU s, wall s)."""
    per_worker = requests // CONCURRENCY

    async def worker() -> None:
        for _ in range(per_worker):
            await send(user_sync_call(str(uuid.uuid4())), str(uuid.uuid4()))

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.process_time() - cpu0, time.perf_counter() - t0


async def measure_client(
    client_name: str, stub: StubProc, tls: EngineTLS | None
) -> tuple[float, float, int]:
    """``client_name`` sending to ``stub`` after a warm-up round: (CPU s, wall s, requests)."""
    requests = REQUESTS[client_name] // CONCURRENCY * CONCURRENCY
    if client_name == "aiohttp":
        aio = AiohttpEngine(stub.url, tls.context() if tls else None)
        try:
            await _drive(aio.send, CONCURRENCY)  # warm-up: connections open
            cpu_s, wall_s = await _drive(aio.send, requests)
        finally:
            await aio.aclose()
    else:
        engine = EngineClient(
            base_url=stub.url,
            api_key=API_KEY,
            max_in_flight=CONCURRENCY,
            tls=tls,
            transport="httpx" if client_name == "httpx" else None,
        )

        async def send(call: EngineCall, event_id: str) -> None:
            await engine.send(call, event_id=event_id)

        try:
            await _drive(send, CONCURRENCY)
            cpu_s, wall_s = await _drive(send, requests)
        finally:
            await engine.aclose()
    return cpu_s, wall_s, requests


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


@pytest.mark.timeout(1200)
def test_engine_transport_http1_vs_aiohttp_plain_and_tls(tmp_path: Path) -> None:
    pki: Pki = make_pki(tmp_path / "pki")
    schemes = {
        "http": (None, False),
        "https": (EngineTLS(ca_file=str(pki.ca_cert)), False),
        "https+mTLS": (
            EngineTLS(
                ca_file=str(pki.ca_cert),
                client_cert=str(pki.client_cert),
                client_key=str(pki.client_key),
            ),
            True,
        ),
    }
    figures: list[Figure] = []
    load_before = _load()
    for scheme, (tls, mtls) in schemes.items():
        stub = start_stub(tmp_path, name=f"stub-{scheme}", pki=pki if tls else None, mtls=mtls)
        try:
            best: dict[str, tuple[float, float, int]] = {}
            expected = 0
            for _ in range(ROUNDS):
                for name in REQUESTS:
                    cpu_s, wall_s, n = asyncio.run(measure_client(name, stub, tls))
                    expected += n + CONCURRENCY
                    previous = best.get(name)
                    if previous is None or cpu_s / n < previous[0] / previous[2]:
                        best[name] = (cpu_s, wall_s, n)
            stats = stub.stats()
            assert stats["applied"] == expected, stats
            assert stats["rejected"] == 0, stats
        finally:
            stub.proc.close()
        for name, (cpu_s, wall_s, n) in best.items():
            figures.append(Figure(scheme, name, n, cpu_s / n * 1e6, n / wall_s))
    load_after = _load()
    base = {f.scheme: f for f in figures if f.client == "http1"}
    print_table(
        f"engine client transport, {CONCURRENCY} in flight, stub in its own process"
        f" (best of {ROUNDS} rounds; before: {load_before}; after: {load_after})",
        [
            "scheme",
            "client",
            "requests",
            "client CPU us/request",
            "requests/s",
            "CPU vs http1",
            "rate vs http1",
        ],
        [
            [
                f.scheme,
                f.client,
                fmt(f.requests),
                fmt(f.cpu_us_per_request),
                fmt(f.requests_per_s),
                f"{f.cpu_us_per_request / base[f.scheme].cpu_us_per_request:.2f}x",
                f"{f.requests_per_s / base[f.scheme].requests_per_s:.2f}x",
            ]
            for f in figures
        ],
    )
