"""Every NATS subject Kvasir uses, built and parsed in one place.

No other module writes a subject string: roles call :class:`Subjects` (or the wildcard
constants here), so a typo cannot put a worker on a subject the backbone never publishes to.

Layout (``<model>`` is the model fingerprint, see :mod:`kvasir_bus.fingerprint`)::

    kvasir.<model>.x.<layer>.<expert>    expert dispatch, request/reply
    kvasir.<model>.n.<node>              one worker's bundles: a layer step's calls in one request
    kvasir.<model>.coverage.<node>       worker heartbeat
    kvasir.<model>.demand                market's demand map
    kvasir.<model>.market.volunteer.<node>  request/reply: budget in, assignment out (the
                                         node asking; ``kvasir.<model>.market.volunteer``
                                         without it is the older form, open buses only)
    kvasir.<model>.routing               backbone's expert hit statistics
    kvasir.<model>.ledger                contribution events, request/reply (acked batches)
    kvasir.<model>.manifest              request/reply: the backbone answers with the Manifest
    kvasir.<model>.market.status         request/reply: the market's view of one model
    kvasir.<model>.market.node.<node>    request/reply: what the market holds of one node
                                         (credit, audits, quarantine): a worker asks for its own
    kvasir._market.status                request/reply: the market's view of every model

The market serves every model at once, so it subscribes to the ``ALL_*`` wildcards below
(``kvasir.*.coverage.*`` and so on) and reads the model back with :func:`model_of`.
``_market`` can never be a model token (models are letters and digits only), so the overview
subject cannot collide with any model's subjects.

Tokens are checked before they reach a subject: a ``.``, ``*``, ``>`` or space inside a token
would silently change which subscribers match, so bad input raises :class:`ValueError` naming
the token and the value. Layer and expert numbers are written in canonical decimal (no sign,
no leading zeros) because NATS matches tokens as strings: ``x.01.2`` is not ``x.1.2``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

PREFIX = "kvasir"

#: Everything Kvasir publishes, for every model: ``nats sub 'kvasir.>'``.
ALL = f"{PREFIX}.>"

#: Per-kind wildcards over every model (what the market subscribes to).
ALL_COVERAGE = f"{PREFIX}.*.coverage.*"
ALL_ROUTING = f"{PREFIX}.*.routing"
ALL_LEDGER = f"{PREFIX}.*.ledger"
ALL_VOLUNTEER = f"{PREFIX}.*.market.volunteer"
#: Volunteer requests naming their node in the subject: under ``kvasir creds`` a worker may
#: publish only on its own (:func:`kvasir_bus.creds.permissions`), so the server vouches for it.
ALL_VOLUNTEER_NODES = f"{PREFIX}.*.market.volunteer.*"
ALL_STATUS = f"{PREFIX}.*.market.status"
#: A node's own report (credit, audits, quarantine), the node in the subject: under ``kvasir
#: creds`` a worker may ask only for its own (:func:`kvasir_bus.creds.permissions`).
ALL_NODE_REPORTS = f"{PREFIX}.*.market.node.*"
ALL_QUARANTINE = f"{PREFIX}.*.quarantine"
#: Every worker's bundle subject of every model (what a backbone may publish to).
ALL_NODES = f"{PREFIX}.*.n.*"

#: The queue group of balance-mode replicas, one name on every expert subject (a queue group is
#: scoped to its subject, so one name serves them all); workers subscribe in it, and the
#: backbone's hedging assumes it (:mod:`backbone.replicas`).
BALANCE_QUEUE = "kvasir-balance"

#: Request/reply: the market's view of every model it knows (a MarketOverview).
MARKET_OVERVIEW = f"{PREFIX}._market.status"

#: Request/reply, one deployment-wide enrolment service (:mod:`kvasir_bus.enrol`): a server
#: nonce, then a signed join (a worker identity for the volunteer's own key) or renewal.
ENROL_HELLO = f"{PREFIX}._enrol.hello"
ENROL_JOIN = f"{PREFIX}._enrol.join"
#: Event: the enrolment service revoked an enrolled node's key (a quarantine locked the door).
ENROL_REVOKED = f"{PREFIX}._enrol.revoked"
#: Request/reply: every revocation the enrolment service made (the market asks at start).
ENROL_REVOCATIONS = f"{PREFIX}._enrol.revocations"

# A fingerprint is 16 lowercase hex digits; any short alphanumeric name is accepted so that
# tests and hand-made models can use readable names.
_MODEL_RE = re.compile(r"[A-Za-z0-9]{1,64}")
_NODE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,8}")
MAX_INDEX = 999_999_999  # nine digits: far beyond any real layer or expert count


def check_model(model: object) -> str:
    """Return ``model`` if it is a valid model token (1-64 ASCII letters/digits)."""
    if not isinstance(model, str) or not _MODEL_RE.fullmatch(model):
        raise ValueError(f"model {model!r} is not a valid subject token: expected 1-64 ASCII "
                         "letters or digits (the model fingerprint)")
    return model


def check_node(node: object) -> str:
    """Return ``node`` if it is a valid node id (1-64 of ``[A-Za-z0-9_-]``)."""
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node):
        raise ValueError(f"node id {node!r} is not a valid subject token: expected 1-64 "
                         "characters from [A-Za-z0-9_-]")
    return node


def check_index(value: object, what: str) -> int:
    """Return ``value`` as an int if it is a non-negative integer (``what`` names it in errors).

    Accepts Python and numpy integers; rejects bools, floats and strings.
    """
    try:
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            raise TypeError
        number = value.__index__()
    except (AttributeError, TypeError):
        raise ValueError(f"{what} {value!r} is not an integer") from None
    if not 0 <= number <= MAX_INDEX:
        raise ValueError(f"{what} {number} is out of range: expected 0..{MAX_INDEX}")
    return number


class DispatchSubject(NamedTuple):
    """A dispatch subject taken apart: ``kvasir.<model>.x.<layer>.<expert>``."""

    model: str
    layer: int
    expert: int


@dataclass(frozen=True)
class Subjects:
    """Subject builders for one model: ``Subjects(fingerprint).dispatch(layer, expert)``."""

    model: str

    def __post_init__(self) -> None:
        check_model(self.model)

    @property
    def root(self) -> str:
        return f"{PREFIX}.{self.model}"

    # -- expert dispatch ------------------------------------------------------------------
    def dispatch(self, layer: int, expert: int) -> str:
        """``kvasir.<model>.x.<layer>.<expert>``: one expert's request/reply subject."""
        return (f"{self.root}.x.{check_index(layer, 'layer')}"
                f".{check_index(expert, 'expert')}")

    def dispatch_layer(self, layer: int) -> str:
        """``kvasir.<model>.x.<layer>.*``: every expert of one layer."""
        return f"{self.root}.x.{check_index(layer, 'layer')}.*"

    def dispatch_all(self) -> str:
        """``kvasir.<model>.x.*.*``: every expert of every layer."""
        return f"{self.root}.x.*.*"

    def node(self, node: str) -> str:
        """``kvasir.<model>.n.<node>``: one worker's bundle subject (every call of a layer step
        that the backbone sends to that worker, in one request)."""
        return f"{self.root}.n.{check_node(node)}"

    # -- coverage and market --------------------------------------------------------------
    def coverage(self, node: str) -> str:
        """``kvasir.<model>.coverage.<node>``: one worker's heartbeat."""
        return f"{self.root}.coverage.{check_node(node)}"

    def coverage_all(self) -> str:
        """``kvasir.<model>.coverage.*``: every worker's heartbeat."""
        return f"{self.root}.coverage.*"

    def demand(self) -> str:
        """``kvasir.<model>.demand``: the market's demand map."""
        return f"{self.root}.demand"

    def volunteer(self, node: str | None = None) -> str:
        """``kvasir.<model>.market.volunteer.<node>``: request/reply, budget in, assignment
        out, on the asking node's own subject; without ``node`` the older subject (open buses)."""
        if node is None:
            return f"{self.root}.market.volunteer"
        return f"{self.root}.market.volunteer.{check_node(node)}"

    def routing(self) -> str:
        """``kvasir.<model>.routing``: the backbone's expert hit statistics."""
        return f"{self.root}.routing"

    def ledger(self) -> str:
        """``kvasir.<model>.ledger``: contribution events (request/reply: batch in, ack out)."""
        return f"{self.root}.ledger"

    def quarantine(self) -> str:
        """``kvasir.<model>.quarantine``: the backbone caught a node lying in an audit (event)."""
        return f"{self.root}.quarantine"

    def manifest(self) -> str:
        """``kvasir.<model>.manifest``: request/reply, the backbone answers with the Manifest."""
        return f"{self.root}.manifest"

    def status(self) -> str:
        """``kvasir.<model>.market.status``: request/reply, the market's view of this model."""
        return f"{self.root}.market.status"

    def node_report(self, node: str) -> str:
        """``kvasir.<model>.market.node.<node>``: request/reply, what the market holds of one node."""
        return f"{self.root}.market.node.{check_node(node)}"

    def generate(self) -> str:
        """``kvasir.<model>.generate``: request in, tokens streamed to the reply inbox; every
        backbone of the model answers in one queue group (:mod:`kvasir_bus.generate_codec`)."""
        return f"{self.root}.generate"

    def generate_cancel(self) -> str:
        """``kvasir.<model>.generate.cancel``: a client drops its stream (every backbone of the
        model hears it; the one running that request frees its sequence)."""
        return f"{self.root}.generate.cancel"

    def everything(self) -> str:
        """``kvasir.<model>.>``: every subject of this model."""
        return f"{self.root}.>"


def _parse_index(token: str, what: str, subject: str) -> int:
    if not _INDEX_RE.fullmatch(token):
        raise ValueError(f"subject {subject!r}: {what} token {token!r} is not a canonical "
                         "non-negative integer")
    return int(token)


def parse_dispatch(subject: str) -> DispatchSubject:
    """Take ``kvasir.<model>.x.<layer>.<expert>`` apart; ValueError if it is anything else."""
    if not isinstance(subject, str):
        raise ValueError(f"subject {subject!r} is not a string")
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[2] != "x":
        raise ValueError(f"subject {subject!r} is not a dispatch subject "
                         f"({PREFIX}.<model>.x.<layer>.<expert>)")
    try:
        model = check_model(parts[1])
    except ValueError as exc:
        raise ValueError(f"subject {subject!r}: {exc}") from None
    return DispatchSubject(model, _parse_index(parts[3], "layer", subject),
                           _parse_index(parts[4], "expert", subject))


def parse_coverage(subject: str) -> tuple[str, str]:
    """Take ``kvasir.<model>.coverage.<node>`` apart into ``(model, node)``."""
    if not isinstance(subject, str):
        raise ValueError(f"subject {subject!r} is not a string")
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != PREFIX or parts[2] != "coverage":
        raise ValueError(f"subject {subject!r} is not a coverage subject "
                         f"({PREFIX}.<model>.coverage.<node>)")
    try:
        return check_model(parts[1]), check_node(parts[3])
    except ValueError as exc:
        raise ValueError(f"subject {subject!r}: {exc}") from None


def volunteer_node(subject: str) -> str | None:
    """The node of ``kvasir.<model>.market.volunteer.<node>``; None for the older subject
    without one; ValueError for anything else."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) not in (4, 5) or parts[0] != PREFIX or parts[2:4] != ["market", "volunteer"]:
        raise ValueError(f"subject {subject!r} is not a volunteer subject "
                         f"({PREFIX}.<model>.market.volunteer.<node>)")
    try:
        check_model(parts[1])
        return check_node(parts[4]) if len(parts) == 5 else None
    except ValueError as exc:
        raise ValueError(f"subject {subject!r}: {exc}") from None


def parse_node_report(subject: str) -> tuple[str, str]:
    """``kvasir.<model>.market.node.<node>`` -> (model, node); ValueError for anything else."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) != 5 or parts[0] != PREFIX or parts[2:4] != ["market", "node"]:
        raise ValueError(f"subject {subject!r} is not a node report subject ({PREFIX}.<model>.market.node.<node>)")
    try:
        return check_model(parts[1]), check_node(parts[4])
    except ValueError as exc:
        raise ValueError(f"subject {subject!r}: {exc}") from None


def model_of(subject: str) -> str:
    """The model token of any per-model subject ``kvasir.<model>....``; ValueError otherwise.

    ``kvasir._market.status`` and other non-model subjects raise, so a wildcard subscriber can
    tell a real model from anything else.
    """
    if not isinstance(subject, str):
        raise ValueError(f"subject {subject!r} is not a string")
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != PREFIX:
        raise ValueError(f"subject {subject!r} is not a per-model Kvasir subject "
                         f"({PREFIX}.<model>.<kind>...)")
    try:
        return check_model(parts[1])
    except ValueError as exc:
        raise ValueError(f"subject {subject!r}: {exc}") from None
