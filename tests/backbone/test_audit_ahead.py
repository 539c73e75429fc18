"""``Auditor.would_audit`` foretells ``should_audit`` exactly (the dispatcher computes audits ahead on it)."""

import numpy as np

from backbone.audit import AuditConfig, Auditor

ref = np.ones((1, 4), np.float32)


def test_would_audit_foretells_the_next_verdict_of_each_node_and_layer_and_counts_nothing():
    auditor = Auditor(AuditConfig(rate=0.25, probation=3, seed=7))
    plain = Auditor(AuditConfig(rate=0.25, probation=3, seed=7))
    verdicts = []
    for i in range(200):
        node, layer = f"n{i % 3}", i % 2
        asked = [auditor.would_audit(node, layer) for _ in range(i % 3)]  # asked 0, 1 or 2 times
        verdict = auditor.should_audit(node, layer)
        assert all(a == verdict for a in asked), i
        verdicts.append(verdict)
        if verdict:
            auditor.judge(node, ref, ref, exact=True, weight_type=0)
    assert sum(verdicts) >= 200 // 4  # still about one in four, and the probation on top
    assert Auditor(AuditConfig(rate=0.0)).would_audit("n", 0) is False
    assert plain.would_audit("n", 0) is True  # on probation


def test_would_audit_foretells_a_whole_steps_verdicts_across_windows():
    """A step asks for every call of a node at once (``ahead`` = the calls before it in the
    step), before any of their verdicts is taken; steps longer than a window included."""
    for rate in (0.1, 0.25, 0.5):
        auditor = Auditor(AuditConfig(rate=rate, probation=3, seed=11))
        for step in range(300):
            node, layer, k = f"n{step % 2}", step % 3, 1 + step % 9
            foretold = [auditor.would_audit(node, layer, j) for j in range(k)]
            again = [auditor.would_audit(node, layer, j) for j in range(k)]  # asking twice draws nothing new
            verdicts = [auditor.should_audit(node, layer) for _ in range(k)]
            assert foretold == again == verdicts, (rate, step)
            for _ in range(sum(verdicts)):  # the step's audits are judged after its verdicts
                auditor.judge(node, ref, ref, exact=True, weight_type=0)
        assert not all(verdicts)  # past probation: windows decide
