"""A worker's own key and the self-certifying name it gives (:class:`kvasir_bus.attribution.NodeKey`).

On an open bus (no ``--creds``, no ``--enrol``) a node name is otherwise the sender's word: anyone
could answer under it and get the node quarantined. A worker started without ``--node`` is named
by its key instead, and proves every reply with it, so a reply under its name without that proof
is dropped by the backbone as forged.

Where the key lives: ``--node-key FILE`` (created, mode 0600, if missing), ``--node-key fresh``
(a new key for this process only: a new name each start), or by default the first free *slot*
``$XDG_STATE_HOME/kvasir/node-keys/node-<i>.seed`` (``~/.local/state`` without it), created on
first use and kept for the next start, so a worker keeps its name (and the market its credit)
across restarts. A slot is held with an exclusive ``flock`` for the process's lifetime: several
workers started on one machine take ``node-0``, ``node-1``, ... and never share a name.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvasir_bus.attribution import NodeKey
from kvasir_bus.errors import UsageError

FRESH = "fresh"
MAX_SLOTS = 256
_held: list[int] = []  # the slots' lock descriptors, open while the process lives


def state_dir() -> Path:
    """``$XDG_STATE_HOME/kvasir/node-keys`` (``~/.local/state`` without it)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "kvasir" / "node-keys"


def _load_or_create(path: Path, flag: str) -> NodeKey:
    try:
        if path.exists() and path.stat().st_size > 0:
            return NodeKey.load(path)
        key = NodeKey.fresh()
        key.write(path)
        return key
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None


def from_flag(value: str) -> NodeKey:
    """``--node-key FILE|fresh``."""
    if value == FRESH:
        return NodeKey.fresh()
    return _load_or_create(Path(value), "--node-key")


def claim_slot(directory: Path | None = None) -> tuple[NodeKey, Path]:
    """The first key slot no other process holds (locked until this process exits), created if
    need be; UsageError when the state directory cannot be written."""
    directory = directory or state_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UsageError(f"node key directory {directory}: {exc.strerror or exc} "
                         "(give --node-key FILE, or --node-key fresh)") from None
    for i in range(MAX_SLOTS):
        path = directory / f"node-{i}.seed"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise UsageError(f"node key {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another worker on this machine holds it
            os.close(fd)
            continue
        _held.append(fd)
        return _load_or_create(path, "node key"), path
    raise UsageError(f"all {MAX_SLOTS} node key slots in {directory} are held by running workers "
                     "(give --node-key FILE)")
