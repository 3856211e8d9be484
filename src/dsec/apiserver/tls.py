"""TLS for the host-routed port endpoint (``https://{port}-{sandbox_id}.<domain>/``).

E2B clients turn ``get_host(port)`` into ``https://`` URLs (e2b-desktop's stream, the SDK's
envd URL without ``E2B_SANDBOX_URL``), so ``dsec serve`` can listen with TLS for host
routes (``DSEC_PORTS_TLS_PORT``). The certificate is the operator's
(``DSEC_PORTS_TLS_CERT`` and ``DSEC_PORTS_TLS_KEY``: PEM files, e.g. a wildcard
certificate for ``*.<domain>`` from the organisation's CA or ACME), or one dsec makes for
the node (:func:`node_certificate`):

* a certificate authority of this node, ``$DSEC_HOME/ports-tls/ca.pem`` (its key
  ``ca.key``, mode 0600, never leaves the node): what clients trust
  (``SSL_CERT_FILE``, ``httpx.Client(verify=...)``, a browser's authority list);
* a server certificate for ``<domain>`` and ``*.<domain>`` signed by it
  (``server.pem``, ``server.key``), made again when the domain changes or it nears its end;
  for a domain under ``localhost`` (the default, ``dsec.localhost``) also for
  ``localhost``, ``127.0.0.1`` and ``::1``.

ECDSA P-256 keys; the authority is valid for 10 years, the server certificate for 1.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import InvalidRequest

__all__ = ["TlsFiles", "node_certificate", "tls_files_from_env"]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the TLS listener: ``cert`` (chain), ``key``, and the authority that
    signed it when dsec made it (``ca``; None for the operator's own certificate)."""

    cert: Path
    key: Path
    ca: Path | None = None


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def node_certificate(home: Path, domain: str) -> TlsFiles:
    """The node's authority and a server certificate for ``domain`` and ``*.domain``
    under ``<home>/ports-tls/`` (made on first use; the server certificate again when its
    names differ or it expires within 30 days). ``domain`` may carry a ``:port``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = domain.rsplit(":", 1)[0] if ":" in domain else domain
    d = home / "ports-tls"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_pem, ca_key_pem = d / "ca.pem", d / "ca.key"
    cert_pem, key_pem = d / "server.pem", d / "server.key"
    now = datetime.datetime.now(datetime.UTC)

    def load_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
        try:
            cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
            key = serialization.load_pem_private_key(ca_key_pem.read_bytes(), None)
        except (OSError, ValueError):
            return None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.not_valid_after_utc < now:
            return None
        return cert, key

    loaded = load_ca()
    if loaded is None:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dsec"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"dsec node CA ({os.uname().nodename})"),
            ]
        )
        ca = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
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
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        _write(
            ca_key_pem,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            0o600,
        )
        _write(ca_pem, ca.public_bytes(serialization.Encoding.PEM), 0o644)
        cert_pem.unlink(missing_ok=True)
        loaded = (ca, key)
    ca_cert, ca_key = loaded

    wanted = {name, f"*.{name}"}
    addresses: list[str] = []
    if name == "localhost" or name.endswith(".localhost"):
        # the node's own names (the default ports domain, dsec.localhost): path routes on
        # https://localhost:<port> and https://127.0.0.1:<port> verify too
        wanted.add("localhost")
        addresses = ["127.0.0.1", "::1"]
    try:
        current = x509.load_pem_x509_certificates(cert_pem.read_bytes())[0]
        sans = set(
            current.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value.get_values_for_type(x509.DNSName)
        )
        fresh = sans == wanted and current.not_valid_after_utc > now + datetime.timedelta(days=30)
        fresh = fresh and current.issuer == ca_cert.subject and key_pem.exists()
    except (OSError, ValueError, IndexError, x509.ExtensionNotFound):
        fresh = False
    if not fresh:
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = [x509.DNSName(n) for n in sorted(wanted)]
        for address in [name, *addresses]:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(address)))
            except ValueError:
                pass
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"*.{name}")]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write(
            key_pem,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            0o600,
        )
        _write(
            cert_pem,
            cert.public_bytes(serialization.Encoding.PEM)
            + ca_cert.public_bytes(serialization.Encoding.PEM),
            0o644,
        )
    return TlsFiles(cert=cert_pem, key=key_pem, ca=ca_pem)


def tls_files_from_env(home: Path, domain: str | None) -> TlsFiles | None:
    """The TLS listener's files: the operator's (``DSEC_PORTS_TLS_CERT`` +
    ``DSEC_PORTS_TLS_KEY``) or the node's own (:func:`node_certificate`); None when no
    ports domain is set."""
    cert = os.environ.get("DSEC_PORTS_TLS_CERT", "").strip()
    key = os.environ.get("DSEC_PORTS_TLS_KEY", "").strip()
    if bool(cert) != bool(key):
        raise InvalidRequest("DSEC_PORTS_TLS_CERT and DSEC_PORTS_TLS_KEY go together")
    if cert:
        for p in (cert, key):
            if not Path(p).is_file():
                raise InvalidRequest(f"TLS file {p} does not exist")
        return TlsFiles(Path(cert), Path(key))
    if domain is None:
        return None
    return node_certificate(home, domain)
