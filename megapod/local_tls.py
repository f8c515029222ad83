"""`megapod up --tls-dir DIR`: a local CA and a server certificate it signed, for this machine's loopback names.

Made once in DIR and kept (a client told to trust DIR/ca.pem keeps trusting it across restarts); made again
only when a file is missing or the certificate does not cover the names asked for. Clients trust it with
SSL_CERT_FILE=DIR/ca.pem (Python's ssl, httpx, websockets and the SDKs built on them read it).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 397  # the longest a browser accepts a server certificate for


@dataclass(frozen=True)
class LocalTls:
    ca: Path  # what clients trust
    certfile: Path
    keyfile: Path


def ensure_local_tls(directory: Path, names: tuple[str, ...] = LOOPBACK) -> LocalTls:
    """DIR's CA and server certificate for `names` (host names or IP addresses), made if missing."""
    files = LocalTls(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    if all(p.exists() for p in (files.ca, files.certfile, files.keyfile)) and _covers(files.certfile, names):
        return files
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Orpheus MegaPod local CA")])
    ca = (_builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(**_usage(key_cert_sign=True, crl_sign=True)), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]), ca_name, key.public_key())
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(**_usage(digital_signature=True)), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    _write(files.keyfile, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), 0o600)
    _write(files.certfile, server.public_bytes(pem), 0o644)
    _write(files.ca, ca.public_bytes(pem), 0o644)  # the CA's key is not kept: nothing else is ever signed by it
    return files


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))


def _usage(**on: bool) -> dict[str, bool]:
    names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
             "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return {name: on.get(name, False) for name in names}


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _covers(certfile: Path, names: tuple[str, ...]) -> bool:
    """Whether the certificate names every one of `names` and is valid a day from now."""
    cert = x509.load_pem_x509_certificate(certfile.read_bytes())
    tomorrow = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return cert.not_valid_after_utc > tomorrow and all(_general_name(n) in alt for n in names)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # an existing file keeps its mode through O_CREAT
