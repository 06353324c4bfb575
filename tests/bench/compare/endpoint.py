"""The HTTP endpoint of the end-to-end comparison (``test_e2e_compare.py``): a small
HTTP/1.1 server, run as its own process, that takes each POST as one event, waits the
engine latency, answers ``200 {"status": "applied"}`` (``"duplicate"`` for a key seen
before) and records when each event's answer went out.

Why not the engine stub (``outbox-cdc engine-stub``), which the sink benches use:
Debezium Server's HTTP sink (Java's ``HttpClient``, HTTP/2 by default) asks every new
connection to upgrade to h2c (``Upgrade: h2c`` on a POST with a body); the stub's
uvicorn on httptools logs "Unsupported upgrade request" and its engine sees no body
(400 to every event, seen on 3.6.1). This server ignores the upgrade, as HTTP/1.1
allows, and reads the body by its Content-Length. Both contenders post to it, so the
endpoint is the same for both.

An event is keyed by its ``Idempotency-Key`` header (any case: Debezium Server sends
``Idempotency-KEY``, see bench/debezium/server-application.properties); a POST without
one is answered 400 and counted as bad.

Control (GET): ``/_bench/stats`` - requests, events, duplicates, bad requests, the first
and last answer times (``time.time()``), the first event request as it arrived (request
line, headers, body); ``/_bench/keys`` - the keys in the order their
first answers went out.

    python -m tests.bench.compare.endpoint --port P --latency-ms L
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time


class Endpoint:
    """What arrived: the first answer time of each key, in order."""

    def __init__(self, latency_ms: float) -> None:
        self.latency_s = latency_ms / 1000.0
        self.answered: dict[str, float] = {}
        self.requests = 0
        self.duplicates = 0
        self.bad = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        #: The first event request as it arrived (request line, headers, body).
        self.sample: dict[str, object] | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: requests one after the other (keep-alive), until it closes."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ", 2)[:2]
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    self.bad += 1
                    await self._reply(writer, 411, {"error": "length_required"}, close=True)
                    return
                length = int(headers.get("content-length", "0") or 0)
                payload = await reader.readexactly(length) if length else b""
                if method == "GET" and path.startswith("/_bench/"):
                    await self._reply(writer, 200, self._control(path))
                    continue
                if self.sample is None:
                    self.sample = {"head": lines[:-2], "body": payload.decode("utf-8", "replace")}
                status, body = await self._event(headers)
                await self._reply(writer, status, body)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _event(self, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
        self.requests += 1
        key = headers.get("idempotency-key", "")
        if not key:
            self.bad += 1
            return 400, {"error": "missing_idempotency_key"}
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        if key in self.answered:
            self.duplicates += 1
            return 200, {"status": "duplicate"}
        now = time.time()
        self.answered[key] = now
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        return 200, {"status": "applied"}

    def _control(self, path: str) -> object:
        if path.startswith("/_bench/keys"):
            return list(self.answered)
        return {
            "requests": self.requests,
            "events": len(self.answered),
            "duplicates": self.duplicates,
            "bad": self.bad,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "sample": self.sample,
        }

    @staticmethod
    async def _reply(
        writer: asyncio.StreamWriter, status: int, body: object, *, close: bool = False
    ) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        reason = {200: "OK", 400: "Bad Request", 411: "Length Required"}[status]
        head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json"]
        head += [f"content-length: {len(data)}"] + (["connection: close"] if close else [])
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()


async def _main(port: int, latency_ms: float) -> None:
    endpoint = Endpoint(latency_ms)
    server = await asyncio.start_server(endpoint.serve, "127.0.0.1", port, backlog=1024)
    print(f"endpoint on http://127.0.0.1:{port}, latency {latency_ms:g} ms", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args.port, args.latency_ms))


if __name__ == "__main__":
    main()
