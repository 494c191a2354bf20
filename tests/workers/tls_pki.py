"""A throwaway PKI for TLS tests: one CA, a server certificate, client certificates by CN.

Certificates name only what is asked (``names``: DNS names, ``ips``): a client that dials an
address the certificate does not name must say which name to check (``server_name``).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["Pki"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass
class Pki:
    folder: Path

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca = self._sign(_name("hkv-test-ca"), self._ca_key.public_key(), ca=True)
        self.ca = self.folder / "ca.pem"
        self.ca.write_bytes(self._ca.public_bytes(serialization.Encoding.PEM))

    def _sign(self, subject: x509.Name, public: ec.EllipticCurvePublicKey, ca: bool = False,
              names: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(_name("hkv-test-ca")).public_key(public)
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        alt: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        alt += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return builder.sign(self._ca_key, hashes.SHA256())

    def issue(self, cn: str, names: tuple[str, ...] = (), ips: tuple[str, ...] = ()
              ) -> tuple[Path, Path]:
        """A certificate signed by the CA, and its key: (cert.pem, key.pem)."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(_name(cn), key.public_key(), names=names, ips=ips)
        cert_path, key_path = self.folder / f"{cn}.pem", self.folder / f"{cn}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path
