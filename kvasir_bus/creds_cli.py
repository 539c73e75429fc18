"""``kvasir creds``: a deployment's identities (standard NATS ``.creds`` files) and its
nats-server config.

    kvasir creds init DIR --listen 0.0.0.0:4222 [--websocket 0.0.0.0:443] --workers a1,a2
    kvasir creds init DIR --nkey ...             # the older mode: nkey users listed in the config
    kvasir creds migrate OLD NEW                 # an nkey deployment as a JWT one, the same keys
    kvasir creds add-worker DIR NAME
    kvasir creds add-client DIR NAME             # a user of kvasir.<model>.generate, nothing else
    kvasir creds refresh DIR                     # after an upgrade: the same keys, this version's rights
    nats-server -c DIR/nats.conf                 # or: kvasir nats --config DIR/nats.conf
    kvasir worker --nats nats://host:4222 --creds DIR/a1.creds --node a1 ...

See :mod:`kvasir_bus.creds` for what each identity may do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvasir_bus.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "creds", help="create a deployment's identities and its nats-server config",
        description="One identity per node: a standard NATS .creds file (a user JWT signed by "
        "the deployment's account, its rights as claims) per backbone, market, observer, "
        "operator, worker and client of the generate API, and a nats-server config that trusts "
        "the deployment's operator. Volunteers get theirs from `kvasir enrol`. An nkey "
        f"deployment (the older mode, --nkey) moves over in one command: {MIGRATE}.",
        epilog="example: kvasir creds init /etc/kvasir --listen 0.0.0.0:4222 --workers phone1,lan2")
    sub = p.add_subparsers(dest="creds_command", metavar="ACTION", parser_class=type(p))
    p.set_defaults(func=cmd_overview)
    init = sub.add_parser("init", help="create DIR with every identity and DIR/nats.conf",
                          epilog="example: kvasir creds init /etc/kvasir --listen 0.0.0.0:4222 "
                          "--websocket 127.0.0.1:8080 --workers phone1,lan2")
    init.add_argument("dir", metavar="DIR", help="new (or empty) directory to create")
    init.add_argument("--listen", metavar="HOST:PORT", required=True,
                      help="client listener of the server, e.g. 0.0.0.0:4222")
    init.add_argument("--websocket", metavar="HOST:PORT", default=None,
                      help="also a WebSocket listener (the 443 path), e.g. 0.0.0.0:443")
    init.add_argument("--ws-tls-cert", metavar="FILE", default=None,
                      help="server certificate for wss:// on --websocket (else no_tls: "
                      "behind a TLS-terminating proxy)")
    init.add_argument("--ws-tls-key", metavar="FILE", default=None,
                      help="private key of --ws-tls-cert")
    init.add_argument("--workers", metavar="NAME,NAME", default="",
                      help="worker identities (each worker's --node)")
    init.add_argument("--clients", metavar="NAME,NAME", default="",
                      help="client identities of the generate API (kvasir.<model>.generate)")
    mode = init.add_mutually_exclusive_group()
    mode.add_argument("--jwt", action="store_true",
                      help="(the default) NATS decentralised auth: an operator and an account "
                      "(DIR/trust/), each identity a standard .creds file (user JWT signed by the "
                      "account, its rights as claims) that nats-py, nats.js and the nats CLI read; "
                      "adding a worker needs no reload, `kvasir enrol` admits volunteers, and a key "
                      "can be revoked at runtime")
    mode.add_argument("--nkey", action="store_true",
                      help="the older mode: every user's nkey listed in DIR/accounts.conf (adding "
                      "one needs a reload, no enrolment, no revocation at runtime)")
    init.set_defaults(func=cmd_init)
    migrate = sub.add_parser("migrate", help="write an nkey deployment OLD as a JWT deployment NEW",
                             description="The same identities, keys, listeners and rights; NEW holds "
                             "an operator, an account and a standard .creds file per identity. Then "
                             "restart nats-server -c NEW/nats.conf and hand out NEW's .creds files "
                             "(each node keeps its public key, so its inbox and name stay).",
                             epilog="example: kvasir creds migrate /etc/kvasir /etc/kvasir-jwt")
    migrate.add_argument("old", metavar="OLD", help="an nkey deployment (kvasir creds init --nkey)")
    migrate.add_argument("new", metavar="NEW", help="new (or empty) directory to create")
    migrate.set_defaults(func=cmd_migrate)
    add = sub.add_parser("add-worker", help="add one worker identity to DIR",
                         epilog="then: nats-server --signal reload  (or restart the server)")
    add.add_argument("dir", metavar="DIR")
    add.add_argument("name", metavar="NAME")
    add.set_defaults(func=cmd_add_worker)
    client = sub.add_parser("add-client", help="add one client of the generate API to DIR",
                            description="A client may publish generate requests and cancels "
                            "(kvasir.<model>.generate[.cancel]) and read its own inbox, nothing else.",
                            epilog="then: nats-server --signal reload  (or restart the server)")
    client.add_argument("dir", metavar="DIR")
    client.add_argument("name", metavar="NAME")
    client.set_defaults(func=cmd_add_client)
    refresh = sub.add_parser("refresh", help="rewrite DIR's server configs with this version's rights",
                             description="The same identities and keys; accounts.conf and nats.conf as "
                             "this version writes them (an upgrade may grant a role something new: "
                             "a worker's bundle subject kvasir.*.n.NODE).",
                             epilog="then: nats-server --signal reload  (or restart the server)")
    refresh.add_argument("dir", metavar="DIR")
    refresh.set_defaults(func=cmd_refresh)


def cmd_init(args: argparse.Namespace) -> int:
    from kvasir_bus import creds

    if (args.ws_tls_cert is None) != (args.ws_tls_key is None):
        raise UsageError("--ws-tls-cert and --ws-tls-key go together")
    tls = (args.ws_tls_cert, args.ws_tls_key) if args.ws_tls_cert else None
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    dep = creds.init(args.dir, args.listen, workers, websocket=args.websocket, websocket_tls=tls,
                     clients=clients, auth="nkey" if args.nkey else "jwt")
    out = Path(args.dir)
    for ident in dep.identities:
        print(f"{ident.role:9s} {out / (ident.name + '.creds')}  {ident.public_key}")
    print(f"server    nats-server -c {out / 'nats.conf'}", file=sys.stderr)
    return 0


MIGRATE = "kvasir creds migrate OLD NEW"


def cmd_overview(args: argparse.Namespace) -> int:
    """``kvasir creds`` alone: what it does, and the one command that migrates."""
    print("kvasir creds ACTION: init, add-worker, add-client, refresh, migrate (see --help)")
    print(f"migrating an nkey deployment to NATS JWTs (.creds files, enrolment, revocation): "
          f"{MIGRATE}, then nats-server -c NEW/nats.conf")
    return 0


def _reload_hint(directory: str) -> None:
    from kvasir_bus import creds

    if creds.load(directory).auth == "jwt":
        print("no reload needed: the server trusts every user JWT the account signs", file=sys.stderr)
    else:
        print("reload the server to admit it: nats-server --signal reload "
              f"(or migrate to JWTs, which need none: {MIGRATE})", file=sys.stderr)


def cmd_add_worker(args: argparse.Namespace) -> int:
    from kvasir_bus import creds

    ident = creds.add_worker(args.dir, args.name)
    print(f"worker    {Path(args.dir) / (ident.name + '.creds')}  {ident.public_key}")
    _reload_hint(args.dir)
    return 0


def cmd_add_client(args: argparse.Namespace) -> int:
    from kvasir_bus import creds

    ident = creds.add_client(args.dir, args.name)
    print(f"client    {Path(args.dir) / (ident.name + '.creds')}  {ident.public_key}")
    _reload_hint(args.dir)
    if creds.load(args.dir).auth == "jwt":
        print("restart the backbone: its new .creds may stream tokens to this client", file=sys.stderr)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from kvasir_bus import creds

    dep = creds.migrate(args.old, args.new)
    out = Path(args.new)
    for ident in dep.identities:
        print(f"{ident.role:9s} {out / (ident.name + '.creds')}  {ident.public_key}")
    print(f"server    nats-server -c {out / 'nats.conf'}  (restart it with this config; hand each "
          "node its new .creds file)", file=sys.stderr)
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    from kvasir_bus import creds

    dep = creds.refresh(args.dir)
    print(f"rewrote {Path(args.dir) / 'accounts.conf'} and nats.conf for {len(dep.identities)} identities")
    print("reload the server to apply them: nats-server --signal reload", file=sys.stderr)
    return 0
