"""Replies attributable to their sender: a per-node HMAC key agreed at enrolment.

On a per-expert subject every holder of the expert receives the request, so the node name in a
reply is the sender's word. An enrolled node (:mod:`kvasir_bus.enrol`) gets ``key =
HMAC-SHA256(reply secret, b"kvasir-reply-v1\\0" || node name)`` sealed to it at enrolment; it
sends each reply with header ``Kvasir-Proof: hex(HMAC-SHA256(key, payload)[:16])``, the payload
being the reply's exact msgpack bytes as sent (they hold the request id, the node name and the
rows, so a proof never fits another call or another node). A backbone holding the deployment's
reply secret derives any node's key from its name alone (:class:`ProofChecker`) and drops a
reply naming an enrolled node whose proof is missing or wrong: it is counted as a forgery, never
against the named node.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections import OrderedDict

PROOF_HEADER = "Kvasir-Proof"
REPLY_KEY_CONTEXT = b"kvasir-reply-v1\0"
TAG_BYTES = 16
#: The names enrolment gives (``v`` and 12 base32 characters of the key): replies naming one
#: must carry a proof where the backbone checks them.
ENROLLED_NAME = re.compile(r"v[a-z2-7]{12}")


def reply_key(secret: bytes, node: str) -> bytes:
    """The HMAC key of node ``node``'s replies."""
    return hmac.new(secret, REPLY_KEY_CONTEXT + node.encode(), hashlib.sha256).digest()


def proof(key: bytes, payload: bytes) -> str:
    """The ``Kvasir-Proof`` header value of ``payload`` under ``key``."""
    return hmac.new(key, payload, hashlib.sha256).digest()[:TAG_BYTES].hex()


class ProofChecker:
    """Checks replies against the deployment's reply secret; node keys cached (bounded)."""

    def __init__(self, secret: bytes, max_keys: int = 65_536):
        self.secret, self.max_keys = secret, max_keys
        self._keys: OrderedDict[str, bytes] = OrderedDict()

    def needs_proof(self, node: str) -> bool:
        return ENROLLED_NAME.fullmatch(node) is not None

    def key(self, node: str) -> bytes:
        k = self._keys.get(node)
        if k is None:
            k = self._keys[node] = reply_key(self.secret, node)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        return k

    def holds(self, node: str, payload: bytes, headers: dict | None) -> bool:
        """Whether a reply naming ``node`` is attributable to it (True for names that need none)."""
        if not self.needs_proof(node):
            return True
        tag = (headers or {}).get(PROOF_HEADER)
        return isinstance(tag, str) and hmac.compare_digest(tag, proof(self.key(node), payload))
