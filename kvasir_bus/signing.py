"""Signed facts: what moves money or trust carries the backbone's nkey signature.

Ledger batches, routing statistics and quarantine events are signed by the backbone that made
them, with an nkey (ed25519, NATS's own key format, the ``nkeys`` package), over the message's
exact payload bytes (the msgpack record as published, nothing else). Two headers carry it:

* ``Kvasir-Signer``: the signer's public nkey (``U...``, 56 characters);
* ``Kvasir-Sig``: the ed25519 signature of the payload, base64url without padding (86 characters).

The market accepts such a record only when the signature verifies *and* the signer is one of
the backbone keys it was told to trust (``kvasir market --trust-backbone KEY``; ``kvasir up``
wires it). Anyone can publish on an open bus; nobody without a trusted backbone's seed can make
a credit, a routing bound or a quarantine out of it. docs/protocol.md gives the bytes.

The backbone's seed: ``$KVASIR_BACKBONE_SEED`` (an nkey seed, ``SU...``), else ``--sign-key
FILE`` (the first ``SU...`` line of the file: a plain seed file or a NATS ``.creds`` file), else
a fresh key for this process, whose public key the backbone logs at start (``signing_key``).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from pathlib import Path

from kvasir_bus.errors import UsageError

SIGNER_HEADER = "Kvasir-Signer"
SIG_HEADER = "Kvasir-Sig"
SEED_ENV = "KVASIR_BACKBONE_SEED"
_SEED_RE = re.compile(rb"SU[A-Z2-7]{56}")
_PUBLIC_RE = re.compile(r"U[A-Z2-7]{55}")


class SignatureError(ValueError):
    """Why a record's signature is refused (one short phrase)."""


def _crc16(data: bytes) -> int:
    return binascii.crc_hqx(data, 0)


def decode_public_key(key: str) -> bytes:
    """A user public nkey (``U...``) -> its 32 raw ed25519 bytes; ValueError if it is not one."""
    if not isinstance(key, str) or not _PUBLIC_RE.fullmatch(key):
        raise ValueError(f"not a user public nkey (U followed by 55 base32 characters): {key[:60]!r}")
    raw = base64.b32decode(key)
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if _crc16(body) != crc or len(body) != 33:
        raise ValueError(f"public nkey {key[:8]}...: bad checksum")
    return body[1:]


def check_public_key(key: str, flag: str = "--trust-backbone") -> str:
    try:
        decode_public_key(key)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    return key


class Signer:
    """Signs payloads with one nkey seed."""

    def __init__(self, seed: bytes):
        import nkeys

        try:
            self._kp = nkeys.from_seed(bytearray(seed))
        except Exception as exc:
            raise UsageError(f"backbone signing key: not an nkey seed ({type(exc).__name__})") from None
        self.public_key = self._kp.public_key.decode()
        self._seed = bytes(seed)

    def write(self, path: str | os.PathLike) -> Path:
        """Save the seed (mode 0600) for a backbone started with ``--sign-key path``."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._seed + b"\n")
        return path

    @classmethod
    def fresh(cls) -> "Signer":
        import nkeys

        return cls(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Signer":
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"--sign-key {path}: {exc.strerror or exc}") from None
        found = _SEED_RE.search(data)
        if found is None:
            raise UsageError(f"--sign-key {path}: no user nkey seed (SU...) in the file")
        return cls(found.group(0))

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Signer":
        """``$KVASIR_BACKBONE_SEED``, else ``path``, else a fresh key."""
        env = os.environ.get(SEED_ENV, "").strip()
        if env:
            return cls(env.encode())
        if path:
            return cls.from_file(path)
        return cls.fresh()

    def sign(self, payload: bytes) -> str:
        return base64.urlsafe_b64encode(self._kp.sign(bytes(payload))).rstrip(b"=").decode()

    def headers(self, payload: bytes) -> dict[str, str]:
        """The two headers that sign ``payload``."""
        return {SIGNER_HEADER: self.public_key, SIG_HEADER: self.sign(payload)}


class Verifier:
    """Checks signed records against a set of trusted public keys (cached verify keys)."""

    def __init__(self, trusted: tuple[str, ...] | list[str] = ()):
        from nacl.signing import VerifyKey

        self.trusted = tuple(dict.fromkeys(trusted))
        self._keys = {key: VerifyKey(decode_public_key(key)) for key in self.trusted}

    @property
    def enforcing(self) -> bool:
        return bool(self._keys)

    def check(self, payload: bytes, headers: dict | None) -> str:
        """The trusted signer of ``payload``; SignatureError saying why not."""
        from nacl.exceptions import BadSignatureError

        headers = headers or {}
        signer, sig = headers.get(SIGNER_HEADER), headers.get(SIG_HEADER)
        if not signer or not sig:
            raise SignatureError("unsigned")
        key = self._keys.get(signer)
        if key is None:
            raise SignatureError("signed by a key that is not trusted")
        try:
            raw = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
            key.verify(bytes(payload), raw)
        except (BadSignatureError, binascii.Error, ValueError):
            raise SignatureError("bad signature") from None
        return signer
