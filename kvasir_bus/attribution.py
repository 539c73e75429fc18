"""Replies attributable to their sender: a per-node HMAC key agreed at enrolment.

On a per-expert subject every holder of the expert receives the request, so the node name in a
reply is the sender's word. An enrolled node (:mod:`kvasir_bus.enrol`) gets ``key =
HMAC-SHA256(reply secret, b"kvasir-reply-v1\\0" || node name)`` sealed to it at enrolment; it
sends each reply with header ``Kvasir-Proof: hex(HMAC-SHA256(key, payload)[:16])``, the payload
being the reply's exact msgpack bytes as sent (they hold the request id, the node name and the
rows, so a proof never fits another call or another node). A backbone holding the deployment's
reply secret derives any node's key from its name alone (:class:`ProofChecker`) and drops a
reply whose proof is missing or wrong: it is counted as a forgery, never against the named node.
Fixed ``kvasir creds`` workers get the same key, derived from their identity's name, in their
credentials file (:data:`REPLY_KEY_LINE`), so under creds a worker cannot answer per expert
under another worker's name either: with the secret, every name needs its proof.

**Self-certifying names** (an open bus: no secret, no enrolment). A worker without an identity
holds an ed25519 key pair (:class:`NodeKey`, an nkey seed) and is named by it: ``k`` and the
first 26 base32 characters of ``SHA-256(b"kvasir-node-v1\0" || public key)`` (130 bits: finding
another key with the same name is a second preimage, about 2^130 key generations). Every request
carries the backbone's X25519 public key (``box``, a fresh key per backbone process); the worker
turns its ed25519 key into its X25519 form, agrees a key with the backbone's,
``K = HMAC-SHA256(X25519(node, box), b"kvasir-reply-dh-v1\0" || node public key || box)``
(cached per backbone), and ends every reply's msgpack map with two entries: ``key`` (bin 32, its
ed25519 public key) and ``proof`` (bin 16, ``HMAC-SHA256(K, SHA-256(the request's payload) ||
every byte of the reply's payload before these 16)[:16]``: bound to the rows it was asked, so an
honest node made to answer a stranger's rows under the backbone's request id proves nothing).
The backbone checks ``name == H(key)`` and the tag with its own half of the
agreement (both cached per node key): one HMAC per reply, as cheap as the enrolled proof, and
only the node's key or the backbone's can make it (``bench/self_proof.py`` measures it against
an ed25519 signature). The proof rides in the payload, not a header, so a reply keeps the
worker's direct socket path and the backbone's engine-thread path.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from collections import OrderedDict
from pathlib import Path

PROOF_HEADER = "Kvasir-Proof"
REPLY_KEY_CONTEXT = b"kvasir-reply-v1\0"
TAG_BYTES = 16
#: The names enrolment gives (``v`` and 12 base32 characters of the key). A backbone holding the
#: reply secret takes a reply naming any node but a self-certifying one only with its proof:
#: enrolled nodes get their key at enrolment, ``kvasir creds`` workers in their creds file.
ENROLLED_NAME = re.compile(r"v[a-z2-7]{12}")
#: The line of a ``kvasir creds`` worker's credentials file that holds its reply key (hex).
REPLY_KEY_LINE = "# kvasir reply key:"


def reply_key_in(path: str | os.PathLike) -> bytes:
    """The reply key in credentials file ``path`` (:data:`REPLY_KEY_LINE`), b"" if it has none;
    ValueError for a line that is not 32 bytes of hex."""
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith(REPLY_KEY_LINE):
            try:
                key = bytes.fromhex(line[len(REPLY_KEY_LINE):].strip())
            except ValueError:
                key = b""
            if len(key) != 32:
                raise ValueError(f"{path}: the reply key line is not 32 bytes of hex")
            return key
    return b""


def reply_key(secret: bytes, node: str) -> bytes:
    """The HMAC key of node ``node``'s replies."""
    return hmac.new(secret, REPLY_KEY_CONTEXT + node.encode(), hashlib.sha256).digest()


def proof(key: bytes, payload: bytes) -> str:
    """The ``Kvasir-Proof`` header value of ``payload`` under ``key``."""
    return hmac.new(key, payload, hashlib.sha256).digest()[:TAG_BYTES].hex()


# -- self-certifying names -------------------------------------------------------------------

NAME_CONTEXT = b"kvasir-node-v1\0"
DH_CONTEXT = b"kvasir-reply-dh-v1\0"
#: ``k`` and 26 base32 characters of the key's hash: 130 bits.
SELF_NAME = re.compile(r"k[a-z2-7]{26}")
SELF_NAME_CHARS = 27
#: The two map entries that end a self-certifying node's reply: ``"key": bin 32`` (its ed25519
#: public key), then ``"proof": bin 16`` (the tag). The tag covers every byte before its own 16.
KEY_ENTRY = b"\xa3key\xc4\x20"
PROOF_ENTRY = b"\xa5proof\xc4\x10"
SEAL_BYTES = len(KEY_ENTRY) + 32 + len(PROOF_ENTRY) + TAG_BYTES  # 62


def self_name(public: bytes) -> str:
    """The self-certifying node name of an ed25519 public key (32 bytes)."""
    digest = hashlib.sha256(NAME_CONTEXT + public).digest()
    return "k" + base64.b32encode(digest).decode().lower()[:SELF_NAME_CHARS - 1]


def is_self_name(node: str) -> bool:
    return len(node) == SELF_NAME_CHARS and node[0] == "k" and SELF_NAME.fullmatch(node) is not None


def _agreed(shared: bytes, node_public: bytes, box: bytes) -> bytes:
    return hmac.new(shared, DH_CONTEXT + node_public + box, hashlib.sha256).digest()


def tag(k: bytes, request, signed) -> bytes:
    """``HMAC-SHA256(K, SHA-256(request) || signed)[:16]``: ``signed`` is the reply's payload up
    to the tag, ``request`` the payload of the request (or bundle) it answers, so a proof fits
    only the rows the backbone sent: a stranger who sends the node other rows under the
    backbone's reply subject and request id gets a proof the backbone refuses."""
    h = hmac.new(k, hashlib.sha256(request).digest(), hashlib.sha256)
    h.update(signed)
    return h.digest()[:TAG_BYTES]


class NodeKey:
    """A worker's own key pair (ed25519, kept as an nkey user seed ``SU...``) and the name it gives.

    :meth:`seal` ends a reply's map with the node's public key and its proof to the backbone
    whose ``box`` the request carried; the agreed key is cached per backbone (bounded: a
    stranger's requests with made-up boxes cost one X25519 each, no memory)."""

    def __init__(self, seed: bytes, max_peers: int = 64):
        from nacl import bindings as nb

        if len(seed) != 32:
            raise ValueError("a node key seed is 32 bytes")
        self.public, secret = nb.crypto_sign_seed_keypair(seed)
        self._seed = seed
        self._x_secret = nb.crypto_sign_ed25519_sk_to_curve25519(secret)
        self.name = self_name(self.public)
        self._tail = KEY_ENTRY + self.public + PROOF_ENTRY
        self._peers: OrderedDict[bytes, bytes | None] = OrderedDict()
        self.max_peers = max_peers

    @classmethod
    def fresh(cls) -> "NodeKey":
        return cls(os.urandom(32))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NodeKey":
        """The key in ``path`` (an nkey user seed, ``SU...``: a seed file or a ``.creds`` file);
        ValueError saying why not."""
        import nkeys

        found = re.search(rb"SU[A-Z2-7]{56}", Path(path).read_bytes())
        if found is None:
            raise ValueError(f"{path}: no user nkey seed (SU...) in the file")
        try:
            prefix, raw = nkeys.decode_seed(bytearray(found.group(0)))
        except Exception:
            raise ValueError(f"{path}: not an nkey seed") from None
        return cls(bytes(raw))

    def seed_text(self) -> bytes:
        import nkeys

        return bytes(nkeys.encode_seed(self._seed, nkeys.PREFIX_BYTE_USER))

    def write(self, path: str | os.PathLike) -> Path:
        """Save the seed (mode 0600), for the next start under the same name."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.seed_text() + b"\n")
        return path

    def agreed(self, box: bytes) -> bytes | None:
        """``K`` with the backbone whose X25519 public key is ``box``; None for a key X25519
        refuses (a low-order point: no proof, the reply goes out without one)."""
        peers = self._peers
        if box in peers:
            return peers[box]
        from nacl import bindings as nb

        try:
            k = _agreed(nb.crypto_scalarmult(self._x_secret, box), self.public, box)
        except Exception:  # nacl refuses an all-zero shared secret
            k = None
        peers[box] = k
        while len(peers) > self.max_peers:
            peers.popitem(last=False)
        return k

    def seal(self, payload: bytes, box: bytes, request: bytes) -> bytes:
        """``payload`` (a reply's msgpack map) with ``key`` and ``proof`` appended, the proof
        bound to ``request`` (the payload of the request it answers, as received), or unchanged
        when there is no box to prove to (a request without one, an invalid one)."""
        k = self.agreed(box) if box else None
        if k is None or not payload:
            return payload
        b0 = payload[0]
        if 0x80 <= b0 <= 0x8d:  # a fixmap of up to 13 entries: two more still fit
            head, skip = bytes((b0 + 2,)), 1
        elif b0 == 0xde and int.from_bytes(payload[1:3], "big") <= 0xfffd:  # map16
            head, skip = b"\xde" + (int.from_bytes(payload[1:3], "big") + 2).to_bytes(2, "big"), 3
        else:
            return payload
        signed = b"".join((head, memoryview(payload)[skip:], self._tail))
        return signed + tag(k, request, signed)


class ProofChecker:
    """Checks replies: self-certifying names always (the backbone's own ``box`` key, fresh per
    process), enrolled names against the deployment's reply secret when it has one. Node keys
    cached (bounded)."""

    def __init__(self, secret: bytes = b"", max_keys: int = 65_536, max_peers: int = 4096):
        from nacl.public import PrivateKey

        self.secret, self.max_keys = secret, max_keys
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._box = PrivateKey.generate()
        self.box = bytes(self._box.public_key)  # announced in every request and bundle (``box``)
        self._peers: OrderedDict[bytes, tuple[str, bytes]] = OrderedDict()  # node public key -> (name, K)
        self.max_peers = max_peers  # ~250 bytes each

    self_named = staticmethod(is_self_name)

    def needs_proof(self, node: str) -> bool:
        return is_self_name(node) or bool(self.secret)

    def key(self, node: str) -> bytes:
        k = self._keys.get(node)
        if k is None:
            k = self._keys[node] = reply_key(self.secret, node)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        return k

    def holds(self, node: str, payload: bytes, headers: dict | None = None, request: bytes | None = None) -> bool:
        """Whether a reply naming ``node`` is attributable to it (True for names that need none).
        ``request``: the payload of the request it answers (a self-certifying node's proof is
        bound to it; None: not known here, so no such reply holds)."""
        if is_self_name(node):
            return request is not None and self.sealed_by(node, payload, request)
        if not self.secret:
            return True
        given = (headers or {}).get(PROOF_HEADER)
        return isinstance(given, str) and hmac.compare_digest(given, proof(self.key(node), payload))

    def sealed_by(self, node: str, payload: bytes, request: bytes) -> bool:
        """Whether ``payload`` ends with a valid ``key`` and ``proof`` of the node named ``node``
        for ``request`` (:meth:`NodeKey.seal`): the key hashes to the name, the tag verifies under
        the agreed key."""
        if type(payload) is not bytes or len(payload) <= SEAL_BYTES:
            return False
        end = len(payload)
        if payload[end - SEAL_BYTES:end - SEAL_BYTES + 6] != KEY_ENTRY or \
                payload[end - 24:end - 16] != PROOF_ENTRY:
            return False
        public = payload[end - 56:end - 24]
        peer = self._peers.get(public)
        if peer is None:
            if self_name(public) != node:
                return False
            k = self._agree(public)
            if k is None:
                return False
            peer = self._peers[public] = (node, k)
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        elif peer[0] != node:
            return False
        return hmac.compare_digest(tag(peer[1], request, memoryview(payload)[:end - TAG_BYTES]),
                                   payload[end - TAG_BYTES:])

    def _agree(self, public: bytes) -> bytes | None:
        from nacl import bindings as nb

        try:
            x = nb.crypto_sign_ed25519_pk_to_curve25519(public)
            return _agreed(nb.crypto_scalarmult(bytes(self._box), x), public, self.box)
        except Exception:  # not a point, or a low-order one: nobody's proof
            return None
