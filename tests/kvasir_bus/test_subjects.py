"""Subject builders and parsers: the one place subjects are spelled."""

import numpy as np
import pytest

from kvasir_bus import subjects
from kvasir_bus.subjects import ALL, DispatchSubject, Subjects, parse_coverage, parse_dispatch

FP = "0123456789abcdef"


def test_builders_spell_the_contract_subjects():
    s = Subjects(FP)
    assert s.dispatch(3, 17) == f"kvasir.{FP}.x.3.17"
    assert s.coverage("phone-a_1") == f"kvasir.{FP}.coverage.phone-a_1"
    assert s.demand() == f"kvasir.{FP}.demand"
    assert s.volunteer() == f"kvasir.{FP}.market.volunteer"
    assert s.routing() == f"kvasir.{FP}.routing"
    assert s.ledger() == f"kvasir.{FP}.ledger"


def test_wildcards():
    s = Subjects(FP)
    assert ALL == "kvasir.>"
    assert s.everything() == f"kvasir.{FP}.>"
    assert s.coverage_all() == f"kvasir.{FP}.coverage.*"
    assert s.dispatch_layer(5) == f"kvasir.{FP}.x.5.*"
    assert s.dispatch_all() == f"kvasir.{FP}.x.*.*"


def test_numpy_integers_are_accepted_and_written_in_decimal():
    assert Subjects(FP).dispatch(np.int64(2), np.uint16(255)) == f"kvasir.{FP}.x.2.255"


def test_parse_dispatch_inverts_dispatch():
    s = Subjects(FP)
    for layer, expert in [(0, 0), (47, 255), (999_999_999, 12)]:
        parsed = parse_dispatch(s.dispatch(layer, expert))
        assert parsed == DispatchSubject(FP, layer, expert)
        assert (parsed.model, parsed.layer, parsed.expert) == (FP, layer, expert)


def test_parse_coverage_inverts_coverage():
    assert parse_coverage(Subjects(FP).coverage("n-1")) == (FP, "n-1")


@pytest.mark.parametrize("model", ["", "ab.cd", "a*", "a>", "a b", "ab-cd", "x" * 65, None, 12,
                                   "ünï"])
def test_invalid_model_is_rejected(model):
    with pytest.raises(ValueError, match="model"):
        Subjects(model)


@pytest.mark.parametrize("node", ["", "a.b", "*", ">", "a b", "n" * 65, None, 3, "a/b"])
def test_invalid_node_is_rejected(node):
    with pytest.raises(ValueError, match="node id"):
        Subjects(FP).coverage(node)


@pytest.mark.parametrize("bad", [-1, 1.0, "1", True, None, subjects.MAX_INDEX + 1, np.True_,
                                 np.float32(1)])
def test_invalid_layer_and_expert_are_rejected(bad):
    s = Subjects(FP)
    with pytest.raises(ValueError, match="layer"):
        s.dispatch(bad, 0)
    with pytest.raises(ValueError, match="expert"):
        s.dispatch(0, bad)
    with pytest.raises(ValueError, match="layer"):
        s.dispatch_layer(bad)


@pytest.mark.parametrize("subject", [
    f"kvasir.{FP}.x.1",              # too short
    f"kvasir.{FP}.x.1.2.3",          # too long
    f"nats.{FP}.x.1.2",              # other prefix
    f"kvasir.{FP}.coverage.1.2",     # other kind
    f"kvasir.{FP}.x.01.2",           # not canonical: NATS would see another subject
    f"kvasir.{FP}.x.1.-2",
    f"kvasir.{FP}.x.1.*",            # a wildcard is not a concrete subject
    f"kvasir.{FP}.x.+1.2",
    f"kvasir.{FP}.x. 1.2",
    "kvasir.a-b.x.1.2",              # bad model token
    "",
])
def test_parse_dispatch_rejects_anything_else(subject):
    with pytest.raises(ValueError, match="subject"):
        parse_dispatch(subject)


def test_parse_dispatch_rejects_non_strings():
    with pytest.raises(ValueError, match="not a string"):
        parse_dispatch(b"kvasir.abc.x.1.2")


@pytest.mark.parametrize("subject", [f"kvasir.{FP}.coverage", f"kvasir.{FP}.coverage.a.b",
                                     f"kvasir.{FP}.coverage.*", f"kvasir.{FP}.demand.n"])
def test_parse_coverage_rejects_anything_else(subject):
    with pytest.raises(ValueError, match="subject"):
        parse_coverage(subject)


def test_subjects_is_frozen():
    s = Subjects(FP)
    with pytest.raises(AttributeError):
        s.model = "other"  # type: ignore[misc]


def test_market_subjects():
    s = Subjects(FP)
    assert s.manifest() == f"kvasir.{FP}.manifest"
    assert s.status() == f"kvasir.{FP}.market.status"
    assert subjects.ALL_COVERAGE == "kvasir.*.coverage.*"
    assert subjects.ALL_ROUTING == "kvasir.*.routing"
    assert subjects.ALL_LEDGER == "kvasir.*.ledger"
    assert subjects.ALL_VOLUNTEER == "kvasir.*.market.volunteer"
    assert subjects.ALL_STATUS == "kvasir.*.market.status"
    assert subjects.MARKET_OVERVIEW == "kvasir._market.status"


def test_model_of_reads_the_model_of_any_per_model_subject():
    s = Subjects(FP)
    for subject in (s.dispatch(1, 2), s.coverage("n"), s.demand(), s.volunteer(), s.routing(),
                    s.ledger(), s.manifest(), s.status()):
        assert subjects.model_of(subject) == FP


@pytest.mark.parametrize("subject", [subjects.MARKET_OVERVIEW, "kvasir.a-b.demand", "kvasir",
                                     "nats.abc.demand", "kvasir.abc", "", b"kvasir.abc.x"])
def test_model_of_rejects_anything_else(subject):
    with pytest.raises(ValueError, match="subject"):
        subjects.model_of(subject)


def test_parse_node_report_inverts_node_report():
    s = Subjects("abc123")
    assert s.node_report("tab-a") == "kvasir.abc123.market.node.tab-a"
    assert subjects.parse_node_report(s.node_report("tab-a")) == ("abc123", "tab-a")
    for bad in ("kvasir.abc123.market.status", "kvasir.abc123.market.node", "kvasir.abc.market.node.a.b",
                "kvasir.a-b.market.node.w", f"kvasir.abc123.market.node.{'x' * 65}", None):
        with pytest.raises(ValueError):
            subjects.parse_node_report(bad)
