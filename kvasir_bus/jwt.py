"""NATS JWT v2 (decentralised auth): operator, account and user JWTs signed with nkeys, and the
standard ``.creds`` file that holds a user's JWT and seed.

The encoding follows nats-io/jwt v2: ``base64url(header) "." base64url(claims) "."
base64url(ed25519 signature over the first two parts)``, no padding, with header
``{"typ":"JWT","alg":"ed25519-nkey"}``. ``jti`` is the base32 (no padding) SHA-512/256 of the
claims serialised with ``jti`` empty, ``iat`` the issue time (Unix seconds), ``iss`` the
signer's public key (the operator for an operator or account JWT, the account for a user JWT),
``sub`` the subject's public key, ``nats`` the type-specific claims with ``type`` and
``version: 2``. nats-server checks the signature chain operator -> account -> user and the
user's expiry (``exp``); a user JWT carries its own permissions (``pub``, ``sub``, ``resp``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_NO_LIMIT = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _hash(claims: dict) -> str:
    body = json.dumps({**claims, "jti": ""}, separators=(",", ":")).encode()
    try:
        digest = hashlib.new("sha512_256", body).digest()
    except ValueError:  # an OpenSSL without SHA-512/256: the server never recomputes jti
        digest = hashlib.sha256(body).digest()
    return base64.b32encode(digest).rstrip(b"=").decode()


def new_keypair(prefix: str) -> tuple[bytes, str]:
    """A fresh nkey of kind ``prefix`` ("operator", "account" or "user"): ``(seed, public)``."""
    import nkeys

    byte = {"operator": nkeys.PREFIX_BYTE_OPERATOR, "account": nkeys.PREFIX_BYTE_ACCOUNT,
            "user": nkeys.PREFIX_BYTE_USER}[prefix]
    seed = nkeys.encode_seed(os.urandom(32), byte)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def verify_key(public: str):
    """The ed25519 verify key (PyNaCl, which nkeys uses) of an nkey public key: base32 of
    prefix byte, 32 key bytes, CRC-16 (little endian), checked."""
    import nacl.signing
    import nkeys

    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35 or nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        raise ValueError(f"not an nkey public key: {public[:12]}...")
    return nacl.signing.VerifyKey(raw[1:33])


def public_of(seed: bytes) -> str:
    import nkeys

    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def encode(claims_nats: dict, *, sub: str, name: str, signer_seed: bytes,
           expires: int | None = None, issued: int | None = None,
           issuer_account: str | None = None) -> str:
    """A signed JWT with ``nats`` claims ``claims_nats`` (which must hold ``type``)."""
    import nkeys

    kp = nkeys.from_seed(bytearray(signer_seed))
    claims: dict[str, Any] = {"jti": "", "iat": int(time.time() if issued is None else issued),
                              "iss": kp.public_key.decode(), "name": name, "sub": sub}
    if expires is not None:
        claims["exp"] = int(expires)
    nats = {**claims_nats, "version": 2}
    if issuer_account is not None:
        nats["issuer_account"] = issuer_account
    claims["nats"] = nats
    claims["jti"] = _hash(claims)
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    sig = kp.sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(sig)}"


def decode(token: str, *, verify: bool = True) -> dict:
    """The claims of ``token``; with ``verify``, its signature is checked against ``iss``
    (ValueError if it does not hold)."""
    try:
        head, body, sig = token.strip().split(".")
        header = json.loads(_unb64(head))
        claims = json.loads(_unb64(body))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a JWT: {exc}") from None
    if header.get("alg") != HEADER["alg"]:
        raise ValueError(f"JWT alg {header.get('alg')!r}: expected {HEADER['alg']}")
    if verify:
        try:
            verify_key(claims["iss"]).verify(f"{head}.{body}".encode(), _unb64(sig))
        except Exception as exc:  # nkeys raises its own errors for a bad key or signature
            raise ValueError(f"JWT signature does not verify: {exc or type(exc).__name__}") from None
    return claims


def operator_jwt(operator_seed: bytes, name: str, system_account: str) -> str:
    pub = public_of(operator_seed)
    return encode({"type": "operator", "system_account": system_account}, sub=pub, name=name,
                  signer_seed=operator_seed)


def account_jwt(operator_seed: bytes, account_public: str, name: str, *, jetstream: bool = False,
                revocations: dict[str, int] | None = None) -> str:
    """An account JWT signed by the operator; ``revocations``: user public key -> Unix time
    (every user JWT of that key issued at or before that time is refused)."""
    limits: dict[str, Any] = {"subs": _NO_LIMIT, "data": _NO_LIMIT, "payload": _NO_LIMIT,
                              "imports": _NO_LIMIT, "exports": _NO_LIMIT, "wildcards": True,
                              "conn": _NO_LIMIT, "leaf": _NO_LIMIT}
    if jetstream:
        limits.update({"mem_storage": _NO_LIMIT, "disk_storage": _NO_LIMIT,
                       "streams": _NO_LIMIT, "consumer": _NO_LIMIT})
    nats: dict[str, Any] = {"type": "account", "limits": limits,
                            "default_permissions": {"pub": {}, "sub": {}}}
    if revocations:
        nats["revocations"] = dict(sorted(revocations.items()))
    return encode(nats, sub=account_public, name=name, signer_seed=operator_seed)


def _duration_ns(text: str) -> int:
    units = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * units[suffix]
    raise ValueError(f"duration {text!r}")


def user_permissions(perms: dict) -> dict:
    """A nats-server config ``permissions`` block (as :func:`kvasir_bus.creds.permissions`
    returns) as user JWT claims: ``pub``, ``sub``, ``resp``."""
    out: dict[str, Any] = {"pub": {}, "sub": {}}
    for conf, claim in (("publish", "pub"), ("subscribe", "sub")):
        block = perms.get(conf) or {}
        for kind in ("allow", "deny"):
            if block.get(kind):
                out[claim][kind] = list(block[kind])
    resp = perms.get("allow_responses")
    if resp is True:
        out["resp"] = {"max": 1, "ttl": 0}
    elif isinstance(resp, dict):
        out["resp"] = {"max": int(resp.get("max", 1)),
                       "ttl": _duration_ns(resp["expires"]) if resp.get("expires") else 0}
    return out


def user_jwt(account_seed: bytes, user_public: str, name: str, perms: dict | None, *,
             expires: int | None = None, bearer: bool = False, tags: list[str] | None = None,
             payload: int = _NO_LIMIT, subs: int = _NO_LIMIT) -> str:
    """A user JWT signed by its account, carrying ``perms`` (a config ``permissions`` block;
    None: no restrictions, as for the system account's operator user). ``bearer``: the JWT alone
    admits (the server asks no nonce signature): an enrolment token. ``payload``/``subs``: the
    largest message and the most subscriptions the server lets this user have (-1: no limit)."""
    nats: dict[str, Any] = {"type": "user", "subs": subs, "data": _NO_LIMIT,
                            "payload": payload}
    if bearer:
        nats["bearer_token"] = True
    if tags:
        nats["tags"] = list(tags)
    if perms is not None:
        nats.update(user_permissions(perms))
    else:
        nats.update({"pub": {}, "sub": {}})
    return encode(nats, sub=user_public, name=name, signer_seed=account_seed, expires=expires)


def creds_text(user_jwt_token: str, user_seed: bytes) -> str:
    """A ``.creds`` file as ``nsc`` and ``nats`` tools write it."""
    return ("-----BEGIN NATS USER JWT-----\n"
            f"{user_jwt_token}\n"
            "------END NATS USER JWT------\n"
            "\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n"
            "\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user_seed.decode()}\n"
            "------END USER NKEY SEED------\n"
            "\n"
            "*************************************************************\n")


def read_creds_jwt(path: str | os.PathLike) -> str | None:
    """The user JWT in a ``.creds`` file, None if it holds none."""
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    for i, line in enumerate(lines):
        if "BEGIN NATS USER JWT" in line and i + 1 < len(lines):
            return lines[i + 1].strip()
    return None
