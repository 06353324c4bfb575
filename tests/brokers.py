"""A Kafka broker of the tests' own, with TLS listeners, for the TLS tests.

Started from a test fixture with the stack's jars (``.dev/kafka/libs``, fetched by
``compose/stack.sh up``) and the JVM options of ``compose/stack.sh``'s ``kafka_up``:
one combined KRaft broker/controller (node 1) on loopback, its data and log under a
directory of the test session, stopped (SIGTERM, then SIGKILL) and removed afterwards.

Listeners, each on a port of :func:`tests.harness.free_port`:

* ``SSL`` - TLS with client certificates required (``ssl.client.auth=required``):
  the clients' certificates must be signed by the tests' CA;
* ``SASL_SSL`` - TLS (no client certificate) and SCRAM-SHA-512, with one user
  whose credentials are written into the metadata at format time
  (``kafka-storage format --add-scram``);
* ``INTERNAL`` (plaintext, between the broker and itself) and ``CONTROLLER``
  (plaintext, KRaft): loopback only and never advertised to a client of the tests,
  which bootstrap on ``SSL`` or ``SASL_SSL`` and are told those listeners' addresses.

The broker's key and certificate are PEM files (``ssl.keystore.type=PEM``, Kafka
2.7+), its truststore the tests' CA (``ssl.truststore.type=PEM``): no JKS/PKCS12 file,
no keytool. Every listener advertises ``127.0.0.1``, a name of the server certificate
(:data:`tests.pki.SERVER_NAMES`), so librdkafka's default hostname verification
(``ssl.endpoint.identification.algorithm=https``) passes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import ROOT, free_port
from tests.pki import Pki

#: The jars compose/stack.sh resolves once (Maven Central) for every stack of the checkout.
KAFKA_LIBS = ROOT / ".dev" / "kafka" / "libs"
LOG4J_CONFIG = ROOT / "compose" / "kafka" / "log4j2.properties"
#: A loaded two-core machine starts a JVM broker in 10-40 s; this bounds a broken one.
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 30
#: The mechanism of the SASL_SSL listener (the one the docs show).
SASL_MECHANISM = "SCRAM-SHA-512"
HEAP = ("-Xms128m", "-Xmx384m")


@dataclass
class TlsBroker:
    """A running broker (see the module docstring); :meth:`start` it, :meth:`close` it."""

    root: Path
    pki: Pki
    sasl_user: str
    sasl_password: str
    ssl_port: int = field(default_factory=free_port)
    sasl_ssl_port: int = field(default_factory=free_port)
    internal_port: int = field(default_factory=free_port)
    controller_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def ssl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.ssl_port}"

    @property
    def sasl_ssl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.sasl_ssl_port}"

    @property
    def plaintext_bootstrap(self) -> str:
        """The broker's own plaintext listener (a TLS client there is refused)."""
        return f"127.0.0.1:{self.internal_port}"

    @property
    def log(self) -> Path:
        return self.root / "kafka.log"

    @property
    def _properties(self) -> Path:
        return self.root / "server.properties"

    def _write_properties(self) -> None:
        keystore = self.root / "broker-keystore.pem"
        keystore.write_bytes(self.pki.server_key.read_bytes() + self.pki.server_cert.read_bytes())
        keystore.chmod(0o600)
        listeners = {
            "INTERNAL": self.internal_port,
            "SSL": self.ssl_port,
            "SASL_SSL": self.sasl_ssl_port,
        }
        advertised = ",".join(f"{name}://127.0.0.1:{port}" for name, port in listeners.items())
        mechanism = SASL_MECHANISM.lower()
        self._properties.write_text(
            f"""process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{self.controller_port}
listeners={advertised},CONTROLLER://127.0.0.1:{self.controller_port}
advertised.listeners={advertised}
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL
ssl.keystore.type=PEM
ssl.keystore.location={keystore}
ssl.truststore.type=PEM
ssl.truststore.location={self.pki.ca_cert}
listener.name.ssl.ssl.client.auth=required
listener.name.sasl_ssl.ssl.client.auth=none
sasl.enabled.mechanisms={SASL_MECHANISM}
listener.name.sasl_ssl.{mechanism}.sasl.jaas.config=\
org.apache.kafka.common.security.scram.ScramLoginModule required;
log.dirs={self.root / "data"}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
"""
        )

    def _java(self, *args: str) -> list[str]:
        return [
            "java",
            *HEAP,
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp",
            f"{KAFKA_LIBS}/*",
            *args,
        ]

    def start(self) -> TlsBroker:
        if not any(KAFKA_LIBS.glob("kafka_*.jar")):
            raise RuntimeError(f"no Kafka jars in {KAFKA_LIBS}: run make up (compose/stack.sh)")
        if shutil.which("java") is None:
            raise RuntimeError("no java on PATH: run make up (compose/stack.sh installs it)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_properties()
        scram = f"{SASL_MECHANISM}=[name={self.sasl_user},password={self.sasl_password}]"
        formatted = subprocess.run(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                "-t",
                uuid.uuid4().hex[:22],
                "-c",
                str(self._properties),
                "--add-scram",
                scram,
            ),
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
        if formatted.returncode != 0:
            raise RuntimeError(f"kafka storage format failed:\n{formatted.stderr[-3000:]}")
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self._java("kafka.Kafka", str(self._properties)),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Kafka Server started" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kafka exited during start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"kafka did not start in {START_TIMEOUT_S}s:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
