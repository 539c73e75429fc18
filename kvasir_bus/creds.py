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
    DIR/trust/reply.key    the reply secret (mode 0600): each worker's credentials file holds
                           its reply key, derived from it and the worker's name (a line
                           ``# kvasir reply key: HEX``); a backbone given the secret takes a
                           reply naming a worker only with that worker's proof

Identities: ``backbone``, ``market``, ``observer`` (``kvasir tap`` / ``kvasir status``),
``operator`` (the only user of the ``$SYS`` account), one per worker, named as the worker's
``--node``, and one per client of the generation API (``kvasir creds add-client DIR NAME``).
Anonymous connections are refused: the config has accounts and no ``no_auth_user``.

Rights (:func:`permissions`) follow the message flow of :mod:`kvasir_bus.subjects`:

- worker W: subscribe to dispatch subjects, its own bundle subject ``kvasir.*.n.W`` (no other
  node's) and its own inbox; publish heartbeats only as ``kvasir.*.coverage.W``, volunteer
  requests only as ``kvasir.*.market.volunteer.W``, its own report only as
  ``kvasir.*.market.node.W``, requests for the manifest; answer the requests it receives
  (``allow_responses``), nothing else;
- backbone: the only publisher of dispatch (per expert, and bundles to ``kvasir.*.n.*``),
  routing and ledger; answers manifest requests;
  serves ``kvasir.*.generate`` in the backbones' queue group only, hears its cancels, and
  streams tokens to the clients' inboxes (each client's, named in the config);
- client C: publishes generate requests and cancels (``kvasir.*.generate``,
  ``kvasir.*.generate.cancel``) and reads its own inbox, nothing else (no worker, market or
  observer may call generate);
- market: the only publisher of demand; answers volunteer, status and ledger requests; hears
  the enrolment service's revocations and asks it for them;
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
    #: "nkey": users listed in accounts.conf (reload to add one); "jwt": NATS decentralised auth,
    #: an operator and accounts whose users are JWTs signed by the account key (no reload).
    auth: str = "nkey"

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
    if role == "worker":  # an enrolled worker renews its identity over its own connection
        return {"publish": {"allow": [f"{_P}.*.coverage.{subjects.check_node(name)}",
                                      f"{_P}.*.market.volunteer.{name}", f"{_P}.*.market.node.{name}",
                                      f"{_P}.*.manifest",
                                      subjects.ENROL_HELLO, subjects.ENROL_JOIN]},
                "subscribe": {"allow": [_DISPATCH, f"{_P}.*.n.{subjects.check_node(name)}", inbox,
                                        *service_subjects(role)]},
                "allow_responses": {"max": 1, "expires": RESPONSE_EXPIRY}}
    if role == "backbone":
        return {"publish": {"allow": [_DISPATCH, subjects.ALL_NODES, f"{_P}.*.routing", f"{_P}.*.ledger", f"{_P}.*.quarantine",
                                      f"{_P}.*.market.status", *_JS_BACKBONE,
                                      *(f"{inbox_prefix_for(k)}.>" for k in client_keys)]},
                "subscribe": {"allow": [f"{_P}.*.manifest", f"{_P}.*.coverage.*", inbox,
                                        subjects.ALL_QUARANTINE,  # other backbones' signed verdicts
                                        f"{_GENERATE} {GENERATE_QUEUE}", _GENERATE_CANCEL,  # the queue group only
                                        *service_subjects(role)]},
                "allow_responses": True}
    if role == "client":  # the generation API and its own replies, nothing else
        return {"publish": {"allow": [_GENERATE, _GENERATE_CANCEL]},
                "subscribe": {"allow": [inbox]}}
    if role == "market":
        return {"publish": {"allow": [f"{_P}.*.demand", f"{_P}.*.manifest", subjects.ENROL_REVOCATIONS,
                                      *_JS_MARKET]},
                "subscribe": {"allow": [subjects.ALL_COVERAGE, subjects.ALL_ROUTING,
                                        subjects.ALL_LEDGER, subjects.ALL_VOLUNTEER,
                                        subjects.ALL_VOLUNTEER_NODES, subjects.ALL_NODE_REPORTS, subjects.ENROL_REVOKED,
                                        subjects.ALL_STATUS, subjects.MARKET_OVERVIEW, inbox,
                                        *service_subjects(role)]},
                "allow_responses": True}
    if role == "enrol":  # kvasir enrol: answers hello and join (user JWTs it signs itself)
        return {"publish": {"allow": [subjects.ENROL_REVOKED]},
                "subscribe": {"allow": [subjects.ENROL_HELLO, subjects.ENROL_JOIN, subjects.ENROL_REVOCATIONS,
                                        subjects.ALL_QUARANTINE, inbox, *service_subjects(role)]},
                "allow_responses": True}
    if role == "guest":  # an enrolment token's holder: ask to enrol, read its replies, nothing else
        return {"publish": {"allow": [subjects.ENROL_HELLO, subjects.ENROL_JOIN]},
                "subscribe": {"allow": [inbox]}}
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


def render_accounts(dep: Deployment, directory: Path | None = None) -> str:
    """``accounts.conf``: the two accounts and every user, with ``$SYS`` for the operator; in
    JWT mode the operator, system account and account resolver (:func:`render_trust`)."""
    if dep.auth == "jwt":
        assert directory is not None
        return render_trust(directory)
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
    if dep.auth == "jwt":
        state["auth"] = "jwt"
        _write_user_creds(directory, dep)
    for name, text in ((STATE_FILE, json.dumps(state, indent=2) + "\n"),
                       ("accounts.conf", render_accounts(dep, directory)),
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
                             for i in state["identities"]),
            auth=state.get("auth", "nkey"))
    except FileNotFoundError:
        raise UsageError(f"{directory} holds no deployment ({STATE_FILE} missing): "
                         "create one with `kvasir creds init`") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path} is unreadable: {exc}") from None


#: The deployment's reply secret (32 random bytes, hex), shared with enrolment: every worker's
#: reply key derives from it and its name (:mod:`kvasir_bus.attribution`); a backbone given it
#: (``--reply-secret DIR/trust/reply.key``) takes a reply only with the named worker's proof.
REPLY_SECRET = "trust/reply.key"


def reply_secret(directory: str | os.PathLike) -> bytes:
    """The deployment's reply secret (created on first use, mode 0600)."""
    path = Path(directory) / REPLY_SECRET
    if not path.exists():
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
    return bytes.fromhex(path.read_text().strip())


def _reply_key_line(directory: Path, name: str) -> str:
    """A worker's credentials file line with its reply key (its replies carry ``Kvasir-Proof``)."""
    from kvasir_bus.attribution import REPLY_KEY_LINE, reply_key

    return f"{REPLY_KEY_LINE} {reply_key(reply_secret(directory), name).hex()}\n"


def _new_identity(directory: Path, name: str, role: str, auth: str = "nkey") -> Identity:
    seed, public = new_seed()
    if auth == "jwt":  # the standard .creds file is written by _save, with its user JWT
        _write_secret(directory / USER_SEED_DIR / f"{name}.nk", seed)
        return Identity(name, role, public)
    header = f"{IDENTITY_HEADER} {name} ({role})\n" + (_reply_key_line(directory, name) if role == "worker" else "")
    _write_secret(directory / f"{name}.creds", seed, header)
    return Identity(name, role, public)


def init(directory: str | os.PathLike, listen: str, workers: list[str], *,
         websocket: str | None = None,
         websocket_tls: tuple[str, str] | None = None, clients: list[str] = (),
         auth: str = "nkey") -> Deployment:
    """Create ``directory`` with every identity of a deployment and its server config.
    ``auth="jwt"``: NATS decentralised auth (:func:`render_trust`)."""
    if auth not in ("nkey", "jwt"):
        raise UsageError(f"auth {auth!r}: expected nkey or jwt")
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
    if auth == "jwt":
        _init_trust(out)
    idents = [_new_identity(out, role, role, auth) for role in ROLES]
    idents += [_new_identity(out, name, "worker", auth) for name in workers]
    idents += [_new_identity(out, name, "client", auth) for name in clients]
    dep = Deployment(listen, websocket, websocket_tls, tuple(idents), auth)
    _save(out, dep)
    return dep


def migrate(old: str | os.PathLike, new: str | os.PathLike) -> Deployment:
    """Write the nkey deployment ``old`` as a JWT deployment in ``new``: the same listeners,
    identities and user keys (each node keeps its public key, hence its inbox), a new operator
    and account, a standard ``.creds`` file per identity. ``old`` is left as it was."""
    src = Path(old)
    dep = load(src)
    if dep.auth == "jwt":
        raise UsageError(f"{old} is a JWT deployment already: nothing to migrate")
    out = Path(new)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty: choose a new directory (keys are "
                         "never overwritten)")
    from kvasir_bus.connect import read_seed

    seeds = {i.name: read_seed(src / f"{i.name}.creds") for i in dep.identities}
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    _init_trust(out)
    for name, seed in seeds.items():
        _write_secret(out / USER_SEED_DIR / f"{name}.nk", seed)
    moved = Deployment(dep.listen, dep.websocket, dep.websocket_tls, dep.identities, "jwt")
    _save(out, moved)
    return moved


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
    ident = _new_identity(out, name, kind, dep.auth)
    _save(out, Deployment(dep.listen, dep.websocket, dep.websocket_tls,
                          dep.identities + (ident,), dep.auth))
    return ident


# -- JWT mode: an operator, two accounts, users signed by the account key ---------------------------
TRUST_DIR = "trust"  # DIR/trust/: operator.nk, account.nk, sys-account.nk (seeds, 0600), revocations.json
USER_SEED_DIR = "trust/users"  # DIR/trust/users/NAME.nk: each identity's user seed (0600)
_TRUST_KEYS = ("operator", "account", "sys-account")


def _init_trust(out: Path) -> None:
    from kvasir_bus import jwt

    (out / TRUST_DIR).mkdir(mode=0o700)
    (out / USER_SEED_DIR).mkdir(mode=0o700)
    for name, kind in zip(_TRUST_KEYS, ("operator", "account", "account")):
        seed, _ = jwt.new_keypair(kind)
        _write_secret(out / TRUST_DIR / f"{name}.nk", seed)


def trust_seed(directory: str | os.PathLike, which: str) -> bytes:
    """The seed of ``which`` ("operator", "account", "sys-account") of a JWT deployment."""
    return read_seed_file(Path(directory) / TRUST_DIR / f"{which}.nk")


def read_seed_file(path: Path) -> bytes:
    try:
        return path.read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"cannot read key file {path}: {exc.strerror or exc}") from None


def revocations(directory: str | os.PathLike) -> dict[str, int]:
    """User public key -> Unix time revoked, of a JWT deployment's account."""
    path = Path(directory) / TRUST_DIR / "revocations.json"
    return json.loads(path.read_text()) if path.exists() else {}


def account_public(directory: str | os.PathLike) -> str:
    from kvasir_bus import jwt

    return jwt.public_of(trust_seed(directory, "account"))


def account_claims_jwt(directory: str | os.PathLike, extra_revocations: dict[str, int] | None = None) -> str:
    """The KVASIR account JWT (signed by the operator) with the deployment's revocations."""
    from kvasir_bus import jwt

    revs = {**revocations(directory), **(extra_revocations or {})}
    return jwt.account_jwt(trust_seed(directory, "operator"), account_public(directory), ACCOUNT,
                           jetstream=True, revocations=revs)


def render_trust(directory: Path) -> str:
    """The operator-mode part of the server config: the operator JWT, the system account and a
    ``full`` account resolver (its files in DIR/trust/resolver), preloaded with both account
    JWTs; an updated account JWT (a revocation) is pushed at runtime on
    ``$SYS.REQ.CLAIMS.UPDATE`` (:func:`revoke`), no reload."""
    from kvasir_bus import jwt

    op = trust_seed(directory, "operator")
    sys_pub = jwt.public_of(trust_seed(directory, "sys-account"))
    op_jwt = jwt.operator_jwt(op, "kvasir", sys_pub)
    sys_jwt = jwt.account_jwt(op, sys_pub, SYSTEM_ACCOUNT)
    acc = account_claims_jwt(directory)
    resolver_dir = (directory / TRUST_DIR / "resolver").resolve()
    return "\n".join([
        "# generated by `kvasir creds init --jwt`: NATS decentralised auth. Users are JWTs signed",
        "# by the account key (DIR/trust/account.nk): adding one needs no reload.",
        f"operator: {json.dumps(op_jwt)}",
        f"system_account: {sys_pub}",
        "resolver {",
        "  type: full",
        f"  dir: {json.dumps(str(resolver_dir))}",
        "  allow_delete: false",
        '  interval: "2m"',
        "}",
        "resolver_preload {",
        f"  {account_public(directory)}: {json.dumps(acc)}",
        f"  {sys_pub}: {json.dumps(sys_jwt)}",
        "}",
        ""])


def _write_user_creds(directory: Path, dep: Deployment) -> None:
    """Every identity's standard ``.creds`` file: its user JWT (its rights as claims) and seed."""
    from kvasir_bus import jwt

    acc = trust_seed(directory, "account")
    sys_acc = trust_seed(directory, "sys-account")
    for ident in dep.identities:
        seed = read_seed_file(directory / USER_SEED_DIR / f"{ident.name}.nk")
        if ident.role == "operator":
            token = jwt.user_jwt(sys_acc, ident.public_key, ident.name, None)
        else:
            token = jwt.user_jwt(acc, ident.public_key, ident.name,
                                 permissions(ident.role, ident.name, ident.public_key, dep.client_keys()))
        path = directory / f"{ident.name}.creds"
        tmp = directory / f".{ident.name}.creds.tmp"
        tmp.unlink(missing_ok=True)
        text = jwt.creds_text(token, seed).rstrip("\n")
        if ident.role == "worker":
            text += "\n\n" + _reply_key_line(directory, ident.name).rstrip("\n")
        _write_secret(tmp, text.encode())
        tmp.replace(path)


def issue_user(directory: str | os.PathLike, name: str, role: str, user_public: str,
               expires: int | None = None) -> str:
    """A user JWT for ``user_public`` (a key the caller holds the seed of), signed by the
    deployment's account key: how enrolment gives a volunteer worker its rights."""
    from kvasir_bus import jwt

    perms = permissions(role, name, user_public, load(directory).client_keys())
    return jwt.user_jwt(trust_seed(directory, "account"), user_public, name, perms, expires=expires)


def revoke(directory: str | os.PathLike, public_key: str, when: int | None = None) -> str:
    """Revoke user key ``public_key`` in a JWT deployment: recorded in DIR/trust/revocations.json
    and in the configs (a restarted server keeps it); returns the updated account JWT, which
    :func:`push_account` sends to a running server."""
    import time as _time

    out = Path(directory)
    revs = revocations(out)
    revs[public_key] = int(_time.time() if when is None else when)
    path = out / TRUST_DIR / "revocations.json"
    tmp = out / TRUST_DIR / ".revocations.json.tmp"
    tmp.write_text(json.dumps(revs, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    dep = load(out)
    _save(out, dep)
    return account_claims_jwt(out)


async def push_account(nc, account_jwt_token: str, timeout: float = 5.0) -> dict:
    """Send an account JWT to a running server's resolver (``$SYS.REQ.CLAIMS.UPDATE``) over a
    connection of the system account's user (the ``operator`` identity); the server's answer."""
    claims = account_jwt_token.encode("ascii")  # a JWT's text, not a bus record: no Kvasir headers
    msg = await nc.request("$SYS.REQ.CLAIMS.UPDATE", claims, timeout=timeout)
    try:
        return json.loads(msg.data)
    except ValueError:
        return {"raw": msg.data.decode(errors="replace")}
