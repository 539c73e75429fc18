"""``kvasir status``: every range a person reads is inclusive ``first-last``, in the grid's
column headers, the demand table and the workers' holdings alike."""

import re

from kvasir_bus.market_codec import DemandEntry, MarketStatus, NodeStatus, NodeTotals
from kvasir_bus.wire import Holding
from market.show import holdings_text, status_text

FP = "0123456789abcdef"


def status_of_one_layer_in_two_ranges() -> MarketStatus:
    """Layer 0 of 64 experts cut into ranges of 32: w-1 holds the first, nobody the second."""
    return MarketStatus(
        model=FP, market="market", sent_at=1.0, manifest_known=True, n_layer=1, n_expert=64,
        range_experts=32, expiry_s=10.0,
        nodes=(NodeStatus("w-1", (Holding(0, 0, 32),), (Holding(0, 32, 64),), 1000, 0.0, 0,
                          1.0, "0.1.0", "numpy"),),
        demand=(DemandEntry(0, 0, 32, 1, 1, 0.5, 0.0, 1.0),
                DemandEntry(0, 32, 64, 0, 1, 0.5, 1.0, 2.0)),
        totals=(NodeTotals("w-1", 1, 1, 1.0),))


def test_status_grid_headers_and_worker_holdings_use_the_same_inclusive_ranges():
    text = status_text(status_of_one_layer_in_two_ranges())
    lines = text.splitlines()
    header = lines[lines.index(next(x for x in lines if x.startswith("coverage:"))) + 1]
    assert header.split() == ["layer", "0-31", "32-63"]
    worker = next(x for x in lines if x.strip().startswith("w-1"))
    assert "L0:0-31 (pending L0:32-63)" in worker
    demand_row = next(x for x in lines if x.strip().startswith("L0:"))
    assert demand_row.split()[0] == "L0:32-63"
    # every L<layer>:<a>-<b> printed names one of the grid's columns: nothing half-open
    spans = {m.group(1) for m in re.finditer(r"L\d+:(\d+-\d+)", text)}
    assert spans == {"0-31", "32-63"}


def test_holdings_text_is_inclusive_and_reads_back_as_the_same_holdings():
    held = (Holding(0, 0, 8), Holding(3, 16, 17))
    text = holdings_text(held)
    assert text == "L0:0-7 L3:16-16"
    assert tuple(Holding.parse(part) for part in text.split()) == held
    assert holdings_text(()) == "-"
    assert holdings_text([Holding(0, i, i + 1) for i in range(8)], limit=2) == \
        "L0:0-0 L0:1-1 +6 more"
