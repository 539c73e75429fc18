"""What both transports of enrolment share (:mod:`kvasir_bus.enrol` over the bus and the service
itself, :mod:`kvasir_bus.enrol_http` over HTTP(S)): the protocol version, the signed context, the
size bound, the HTTP path, the refusal and the identity a volunteer gets. A module of its own so
that neither transport imports the other."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvasir_bus import jwt
from kvasir_bus.errors import KvasirError

VERSION = 1
JOIN_CONTEXT = b"kvasir-enrol-v1\0"
MAX_REQUEST_BYTES = 4096  # a join is ~1.2 KB with its token; the guest JWT caps payload here too
HTTP_PATH = "/enrol"  # POST HTTP_PATH/hello, HTTP_PATH/join (kvasir_bus.enrol_http)


class EnrolError(KvasirError):
    """The service refused: ``code`` names why (bad_request, rate_limited, bad_nonce, bad_token,
    bad_signature, revoked, banned, full)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"enrolment refused ({code}): {message}")
        self.code, self.detail = code, message


@dataclass
class Enrolled:
    name: str
    jwt: str
    exp: int
    seed: bytes
    reply_key: bytes
    bus_url: str = ""  # the bus to dial (an HTTP(S) enrolment says; over the bus: the one asked)

    def creds_text(self) -> str:
        return jwt.creds_text(self.jwt, self.seed)

    def write(self, path: str | os.PathLike) -> Path:
        """The standard .creds file (0600), replaced atomically (a reconnect reads it whole)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.creds_text())
        tmp.replace(path)
        return path
