"""Make a federation's key material: a CA, the SuperLink's TLS certificate and one auth key pair per party.

    python deploy/make_certs.py --out certs --parties 3 --san 127.0.0.1 --san superlink.example.org

Writes ``ca.crt`` / ``ca.key`` (keep ``ca.key`` offline), ``superlink.crt`` / ``superlink.key`` for
the SuperLink (``--ssl-ca-certfile ca.crt --ssl-certfile superlink.crt --ssl-keyfile
superlink.key``), and ``party-<i>`` / ``party-<i>.pub``: OpenSSH ECDSA P-384 keys for SuperNode
authentication (the private key stays with party i, the ``.pub`` is registered with
``flwr supernode register``). Private keys are written with mode 0600. Existing files are kept
unless ``--force``, so re-running never rotates a key by accident.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "retexo-fl federation CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA384())
    )
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(out / "ca.key", _pem_key(key), private=True)
    return cert, key


def make_server_cert(out: Path, ca: x509.Certificate, ca_key, sans: list[str], days: int) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(_san(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(out / "superlink.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(out / "superlink.key", _pem_key(key), private=True)


def make_party_key(out: Path, party: int) -> None:
    """An OpenSSH ECDSA P-384 key pair, what ``ssh-keygen -t ecdsa -b 384`` makes."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(out / f"party-{party}", private, private=True)
    _write(out / f"party-{party}.pub", public + f" party-{party}\n".encode(), private=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the key material")
    parser.add_argument("--parties", type=int, default=0, help="SuperNode key pairs to make (party-0 ...)")
    parser.add_argument("--first-party", type=int, default=0, help="number of the first new party key")
    parser.add_argument(
        "--san", action="append", default=[], help="SuperLink address (repeat); default 127.0.0.1"
    )
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--force", action="store_true", help="replace existing files (rotates keys)")
    parser.add_argument(
        "--keys-only", action="store_true", help="a party's own key pairs only: no CA, no certificate"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    # Owner-only: it holds private keys, and `retexo-fl keys --out` refuses a folder others can enter.
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    sans = args.san or ["127.0.0.1", "localhost"]
    made = []
    if args.keys_only:
        pass
    elif args.force or not (out / "ca.crt").is_file():
        make_ca(out, args.days)
        made.append("ca.crt, ca.key")
    if not args.keys_only and (args.force or not (out / "superlink.crt").is_file()):
        ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
        make_server_cert(out, ca, ca_key, sans, args.days)
        made.append(f"superlink.crt, superlink.key (SAN {', '.join(sans)})")
    for i in range(args.first_party, args.first_party + args.parties):
        if args.force or not (out / f"party-{i}").is_file():
            make_party_key(out, i)
            made.append(f"party-{i}, party-{i}.pub")
    print(f"{out}: " + ("; ".join(made) if made else "nothing new (use --force to rotate)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
