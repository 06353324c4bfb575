"""A private PKI made for one test: a CA, a server certificate and a client certificate.

Everything is generated with ``cryptography`` into a directory of PEM files,
so TLS and mTLS tests run against real handshakes with no file checked in.
The server certificate names ``127.0.0.1``, ``::1`` and ``localhost`` unless told otherwise;
the client certificate's common name is ``outbox-cdc-sink`` unless told otherwise (a
PostgreSQL role a server matches it against with ``clientcert=verify-full``), and its
key can be encrypted with a passphrase (what ``sslpassword`` / ``ssl.key.password`` open).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 2
#: What the server certificate is valid for (DNS names and IP addresses).
SERVER_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Pki:
    """PEM files of one private PKI."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, *, with_client_cert: bool = True) -> ssl.SSLContext:
        """A client context trusting this CA (and presenting the client certificate)."""
        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        if with_client_cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path, passphrase: str = "") -> None:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase.encode())
        if passphrase
        else serialization.NoEncryption()
    )
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    common_name: str,
    *,
    server: bool,
    names: tuple[str, ...] = SERVER_NAMES,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(name) for name in names]),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_pki(
    directory: Path,
    *,
    name: str = "test",
    server_names: tuple[str, ...] = SERVER_NAMES,
    client_name: str = "outbox-cdc-sink",
    client_key_passphrase: str = "",
) -> Pki:
    """Generate a CA, a server and a client certificate (EC P-256) under ``directory``.

    The server certificate is valid for ``server_names`` only; the client certificate
    names ``client_name``; its key is encrypted when ``client_key_passphrase`` is given.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"outbox-cdc {name} CA")
    now = dt.datetime.now(dt.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server, server_key = _leaf(ca_key, ca_name, "engine.test", server=True, names=server_names)
    client, client_key = _leaf(ca_key, ca_name, client_name, server=False)
    pki = Pki(
        ca_cert=directory / f"{name}-ca.pem",
        server_cert=directory / f"{name}-server.pem",
        server_key=directory / f"{name}-server.key",
        client_cert=directory / f"{name}-client.pem",
        client_key=directory / f"{name}-client.key",
    )
    _write_cert(ca, pki.ca_cert)
    _write_cert(server, pki.server_cert)
    _write_key(server_key, pki.server_key)
    _write_cert(client, pki.client_cert)
    _write_key(client_key, pki.client_key, client_key_passphrase)
    return pki
