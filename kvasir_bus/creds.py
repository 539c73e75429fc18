"""One identity per node: nkey seed files and the nats-server config that grants each its rights.

``kvasir creds init DIR --listen HOST:PORT --workers a,b`` (see :mod:`kvasir_bus.creds_cli`)
calls :func:`init`, which writes::

    DIR/nats.conf          the server: listeners, limits, ``include accounts.conf``
    DIR/accounts.conf      every identity's public key and permissions (cluster members and
                           leafnode hubs include this same file)
    DIR/<identity>.creds   one user nkey seed per identity (mode 0600), the format ``nk -gen
                           user`` writes, after one comment line naming the identity
                           (``# kvasir identity: w1 (worker)``): a worker's ``--node``
                           defaults to that name (:func:`kvasir_bus.connect.identity_name`)
    DIR/deployment.json    what :func:`add_worker` needs to write the configs again

Identities: ``backbone``, ``market``, ``observer`` (``kvasir tap`` / ``kvasir status``),
``operator`` (the only user of the ``$SYS`` account), one per worker, named as the worker's
``--node``, and one per client of the generation API (``kvasir creds add-client DIR NAME``).
Anonymous connections are refused: the config has accounts and no ``no_auth_user``.

Rights (:func:`permissions`) follow the message flow of :mod:`kvasir_bus.subjects`:

- worker W: subscribe to dispatch subjects, its own bundle subject ``kvasir.*.n.W`` (no other
  node's) and its own inbox; publish heartbeats only as ``kvasir.*.coverage.W``, requests to the
  market (volunteer) and for the manifest; answer the requests it receives
  (``allow_responses``), nothing else;
- backbone: the only publisher of dispatch (per expert, and bundles to ``kvasir.*.n.*``),
  routing and ledger; answers manifest requests;
  serves ``kvasir.*.generate`` in the backbones' queue group only, hears its cancels, and
  streams tokens to the clients' inboxes (each client's, named in the config);
- client C: publishes generate requests and cancels (``kvasir.*.generate``,
  ``kvasir.*.generate.cancel``) and reads its own inbox, nothing else (no worker, market or
  observer may call generate);
- market: the only publisher of demand; answers volunteer, status and ledger requests;
- observer: reads everything under ``kvasir.>``; may only ask the market for its status and
  every service who it is (``$SRV.>``);
- worker, backbone, market: each answers ``$SRV.PING/INFO/STATS`` for its own service name
  (``kvasir-<role>``, :func:`service_subjects`), nothing else under ``$SRV``.

Each identity's reply inbox is ``_INBOX_<its public key>`` (:func:`kvasir_bus.connect.inbox_prefix_for`)
and it may subscribe to no other inbox: nobody reads another node's replies.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvasir_bus import ledger_stream, subjects
from kvasir_bus.connect import IDENTITY_HEADER, inbox_prefix_for
from kvasir_bus.errors import UsageError
from kvasir_bus.generate_codec import GENERATE_QUEUE

ROLES = ("backbone", "market", "observer", "operator")  # fixed identities; the rest are workers or clients
KINDS = ("worker", "client")  # the identities added by name
STATE_FILE = "deployment.json"
ACCOUNT = "KVASIR"
SYSTEM_ACCOUNT = "SYS"
#: A worker may answer each request once, within this time after receiving it. Long enough for
#: a queued 8 MB dispatch on a slow phone; the backbone has given up long before.
RESPONSE_EXPIRY = "2m"

_P = subjects.PREFIX
_DISPATCH = f"{_P}.*.x.*.*"
_GENERATE = f"{_P}.*.generate"
_GENERATE_CANCEL = f"{_P}.*.generate.cancel"
SRV = "$SRV"  # the NATS micro protocol's discovery prefix


@dataclass(frozen=True)
class Identity:
    name: str
    role: str  # one of ROLES, or one of KINDS
    public_key: str


@dataclass(frozen=True)
class Deployment:
    """Where the server listens and who may connect (``DIR/deployment.json``)."""

    listen: str
    websocket: str | None
    websocket_tls: tuple[str, str] | None  # (cert file, key file) for wss:// on the listener
    identities: tuple[Identity, ...]

    def names(self) -> set[str]:
        return {i.name for i in self.identities}

    def client_keys(self) -> tuple[str, ...]:
        return tuple(i.public_key for i in self.identities if i.role == "client")


def service_subjects(role: str) -> list[str]:
    """The ``$SRV`` subjects a role's micro service listens on (:mod:`kvasir_bus.micro`):
    ``$SRV.PING``, ``$SRV.PING.kvasir-<role>``, ``$SRV.PING.kvasir-<role>.<id>`` and the same
    for INFO and STATS. It answers through ``allow_responses``."""
    name = f"kvasir-{role}"
    return [f"{SRV}.*", f"{SRV}.*.{name}", f"{SRV}.*.{name}.*"]


_JS_STREAM = [f"$JS.API.STREAM.INFO.{ledger_stream.STREAM}", f"$JS.API.STREAM.CREATE.{ledger_stream.STREAM}",
              f"$JS.API.CONSUMER.INFO.{ledger_stream.STREAM}.{ledger_stream.CONSUMER}"]
#: The backbone stores ledger, routing and quarantine messages and reads how far the market got.
_JS_BACKBONE = _JS_STREAM
#: The market reads the stream with its one durable consumer and acks what it applied.
_JS_MARKET = [*_JS_STREAM,
              f"$JS.API.CONSUMER.DURABLE.CREATE.{ledger_stream.STREAM}.{ledger_stream.CONSUMER}",
              f"$JS.API.CONSUMER.CREATE.{ledger_stream.STREAM}.{ledger_stream.CONSUMER}",
              f"$JS.API.CONSUMER.CREATE.{ledger_stream.STREAM}.{ledger_stream.CONSUMER}.>",
              f"$JS.API.CONSUMER.MSG.NEXT.{ledger_stream.STREAM}.{ledger_stream.CONSUMER}",
              f"$JS.ACK.{ledger_stream.STREAM}.{ledger_stream.CONSUMER}.>"]


def permissions(role: str, name: str, public_key: str, client_keys: tuple[str, ...] = ()) -> dict:
    """The nats-server ``permissions`` block of one identity (a JSON-able dict).
    ``client_keys``: the public keys of the deployment's clients (the backbone streams tokens
    to their inboxes)."""
    inbox = f"{inbox_prefix_for(public_key)}.>"
    if role == "worker":
        return {"publish": {"allow": [f"{_P}.*.coverage.{subjects.check_node(name)}",
                                      f"{_P}.*.market.volunteer", f"{_P}.*.manifest"]},
                "subscribe": {"allow": [_DISPATCH, f"{_P}.*.n.{subjects.check_node(name)}", inbox,
                                        *service_subjects(role)]},
                "allow_responses": {"max": 1, "expires": RESPONSE_EXPIRY}}
    if role == "backbone":
        return {"publish": {"allow": [_DISPATCH, subjects.ALL_NODES, f"{_P}.*.routing", f"{_P}.*.ledger", f"{_P}.*.quarantine",
                                      f"{_P}.*.market.status", *_JS_BACKBONE,
                                      *(f"{inbox_prefix_for(k)}.>" for k in client_keys)]},
                "subscribe": {"allow": [f"{_P}.*.manifest", f"{_P}.*.coverage.*", inbox,
                                        f"{_GENERATE} {GENERATE_QUEUE}", _GENERATE_CANCEL,  # the queue group only
                                        *service_subjects(role)]},
                "allow_responses": True}
    if role == "client":  # the generation API and its own replies, nothing else
        return {"publish": {"allow": [_GENERATE, _GENERATE_CANCEL]},
                "subscribe": {"allow": [inbox]}}
    if role == "market":
        return {"publish": {"allow": [f"{_P}.*.demand", f"{_P}.*.manifest", *_JS_MARKET]},
                "subscribe": {"allow": [subjects.ALL_COVERAGE, subjects.ALL_ROUTING,
                                        subjects.ALL_LEDGER, subjects.ALL_VOLUNTEER,
                                        subjects.ALL_STATUS, subjects.MARKET_OVERVIEW, inbox,
                                        *service_subjects(role)]},
                "allow_responses": True}
    if role == "observer":  # may ask every service who it is ($SRV.PING/INFO/STATS)
        return {"publish": {"allow": [subjects.ALL_STATUS, subjects.MARKET_OVERVIEW, f"{SRV}.>"]},
                "subscribe": {"allow": [subjects.ALL, inbox]}}
    raise ValueError(f"no permissions for role {role!r}")


# -- keys and files ------------------------------------------------------------------------------
def new_seed() -> tuple[bytes, str]:
    """A fresh user nkey: ``(seed, public key)``."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def _write_secret(path: Path, data: bytes, header: str = "") -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(header.encode() + data + b"\n")


def _check_hostport(value: str, flag: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{flag} {value!r}: expected HOST:PORT, e.g. 0.0.0.0:4222 "
                         "(port 0: any free port, as in tests)")
    return value


def _check_name(name: str, taken: set[str], kind: str = "worker") -> str:
    try:
        subjects.check_node(name)
    except ValueError as exc:
        raise UsageError(f"{kind} name {name!r}: {exc}") from None
    if name in ROLES:
        raise UsageError(f"{kind} name {name!r} is reserved for the {name} identity")
    if name in taken:
        raise UsageError(f"identity {name!r} exists already")
    return name


def _identity_lines(ident: Identity, client_keys: tuple[str, ...]) -> str:
    user = {"nkey": ident.public_key}
    if ident.role != "operator":
        user["permissions"] = permissions(ident.role, ident.name, ident.public_key, client_keys)
    return f"      # {ident.name} ({ident.role})\n      {json.dumps(user)}"


def render_accounts(dep: Deployment) -> str:
    """``accounts.conf``: the two accounts and every user, with ``$SYS`` for the operator."""
    users = [i for i in dep.identities if i.role != "operator"]
    ops = [i for i in dep.identities if i.role == "operator"]
    return "\n".join([
        "# generated by `kvasir creds`; add workers with `kvasir creds add-worker DIR NAME`,",
        "# clients of the generate API with `kvasir creds add-client DIR NAME`",
        "accounts {",
        f"  {ACCOUNT}: {{",
        "    jetstream: enabled  # the ledger stream (kvasir_bus.ledger_stream)",
        "    users: [",
        *[_identity_lines(i, dep.client_keys()) for i in users],
        "    ]",
        "  }",
        f"  {SYSTEM_ACCOUNT}: {{",
        "    users: [",
        *[_identity_lines(i, ()) for i in ops],
        "    ]",
        "  }",
        "}",
        f"system_account: {SYSTEM_ACCOUNT}",
        ""])


def _listen(hostport: str) -> str:
    """HOST:PORT for nats-server, where port 0 (any free port) is nats-server's -1."""
    host, _, port = hostport.rpartition(":")
    return json.dumps(f"{host}:{-1 if int(port) == 0 else port}")


def render_server(dep: Deployment, store_dir: str | None = None) -> str:
    """``nats.conf``: listeners and limits as deploy/nats.conf, JetStream for the ledger stream
    (its files in ``store_dir``), and ``include accounts.conf``."""
    lines = ["# generated by `kvasir creds`: run with  nats-server -c nats.conf  (or kvasir nats --config)",
             f"listen: {_listen(dep.listen)}",
             "max_payload: 8MB",
             "max_pending: 64MB",
             'write_deadline: "10s"',
             'ping_interval: "20s"',
             "ping_max: 3"]
    if dep.websocket is not None:
        lines += ["websocket {", f"  listen: {_listen(dep.websocket)}", "  compression: false"]
        if dep.websocket_tls is not None:
            cert, key = dep.websocket_tls
            lines += ["  tls {", f"    cert_file: {json.dumps(cert)}",
                      f"    key_file: {json.dumps(key)}", "  }"]
        else:
            lines += ["  # no TLS here: put a TLS-terminating proxy in front (wss:// on 443)",
                      "  no_tls: true"]
        lines += ["}"]
    if store_dir is not None:
        lines += ["jetstream {", f"  store_dir: {json.dumps(store_dir)}", "}"]
    lines += ["include accounts.conf", ""]
    return "\n".join(lines)


def _save(directory: Path, dep: Deployment) -> None:
    state = {"listen": dep.listen, "websocket": dep.websocket,
             "websocket_tls": list(dep.websocket_tls) if dep.websocket_tls else None,
             "identities": [{"name": i.name, "role": i.role, "public_key": i.public_key}
                            for i in dep.identities]}
    for name, text in ((STATE_FILE, json.dumps(state, indent=2) + "\n"),
                       ("accounts.conf", render_accounts(dep)),
                       ("nats.conf", render_server(dep, str((directory / "jetstream").resolve())))):
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(directory / name)  # a running server reloading never sees half a file


def load(directory: str | os.PathLike) -> Deployment:
    """The deployment that :func:`init` wrote in ``directory``."""
    path = Path(directory) / STATE_FILE
    try:
        state = json.loads(path.read_text())
        return Deployment(
            listen=state["listen"], websocket=state["websocket"],
            websocket_tls=tuple(state["websocket_tls"]) if state["websocket_tls"] else None,
            identities=tuple(Identity(i["name"], i["role"], i["public_key"])
                             for i in state["identities"]))
    except FileNotFoundError:
        raise UsageError(f"{directory} holds no deployment ({STATE_FILE} missing): "
                         "create one with `kvasir creds init`") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path} is unreadable: {exc}") from None


def _new_identity(directory: Path, name: str, role: str) -> Identity:
    seed, public = new_seed()
    _write_secret(directory / f"{name}.creds", seed, f"{IDENTITY_HEADER} {name} ({role})\n")
    return Identity(name, role, public)


def init(directory: str | os.PathLike, listen: str, workers: list[str], *,
         websocket: str | None = None,
         websocket_tls: tuple[str, str] | None = None, clients: list[str] = ()) -> Deployment:
    """Create ``directory`` with every identity of a deployment and its server config."""
    _check_hostport(listen, "--listen")
    if websocket is not None:
        _check_hostport(websocket, "--websocket")
    if websocket_tls is not None:
        if websocket is None:
            raise UsageError("--ws-tls-cert/--ws-tls-key need --websocket")
        websocket_tls = tuple(str(Path(p).resolve()) for p in websocket_tls)
        for p in websocket_tls:
            if not Path(p).is_file():
                raise UsageError(f"TLS file {p}: no such file")
    taken: set[str] = set()
    for name in workers:
        taken.add(_check_name(name, taken))
    for name in clients:
        taken.add(_check_name(name, taken, "client"))
    out = Path(directory)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty: choose a new directory (keys are "
                         "never overwritten)")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    idents = [_new_identity(out, role, role) for role in ROLES]
    idents += [_new_identity(out, name, "worker") for name in workers]
    idents += [_new_identity(out, name, "client") for name in clients]
    dep = Deployment(listen, websocket, websocket_tls, tuple(idents))
    _save(out, dep)
    return dep


def add_worker(directory: str | os.PathLike, name: str) -> Identity:
    """Add worker ``name`` to the deployment in ``directory``; the configs are rewritten.

    A running server picks the new worker up on ``nats-server --signal reload`` (SIGHUP).
    """
    return _add(directory, name, "worker")


def refresh(directory: str | os.PathLike) -> Deployment:
    """Rewrite the configs in ``directory`` with this version's rights for the same identities
    (after an upgrade that grants a role something new, such as a worker's bundle subject); no
    key changes. A running server takes them on ``nats-server --signal reload``."""
    out = Path(directory)
    dep = load(out)
    _save(out, dep)
    return dep


def add_client(directory: str | os.PathLike, name: str) -> Identity:
    """Add client ``name`` of the generate API (see :func:`permissions`), as :func:`add_worker`.
    The backbone's rights are rewritten too: it may stream tokens to the new client's inbox."""
    return _add(directory, name, "client")


def _add(directory: str | os.PathLike, name: str, kind: str) -> Identity:
    out = Path(directory)
    dep = load(out)
    _check_name(name, dep.names(), kind)
    ident = _new_identity(out, name, kind)
    _save(out, Deployment(dep.listen, dep.websocket, dep.websocket_tls,
                          dep.identities + (ident,)))
    return ident
