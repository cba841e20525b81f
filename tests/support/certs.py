"""Test certificates, made with the openssl CLI as an operator would."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_cert(directory: Path, name: str = "server") -> tuple[Path, Path]:
    """A self-signed EC certificate for localhost (EC: fast to generate)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
