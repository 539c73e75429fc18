"""The coverage market (milestone M3): who holds which experts, where replicas are missing,
who should hold what next, and who earned what.

Pure parts (no I/O, clock passed in): :mod:`market.coverage` (the coverage map from
heartbeats, with expiry and pending assignments), :mod:`market.demand` (ranges, usage from
routing statistics, replica targets, demand and reward rates), :mod:`market.assign` (the
scarcest range(s) that fit a volunteer's budget). :mod:`market.ledger` keeps the contribution
ledger in SQLite; :mod:`market.service` runs it all on the bus; :mod:`market.cli` adds
``kvasir market``, ``kvasir rewards``, ``kvasir status`` and ``kvasir tap``.
"""

#: The ledger file of ``kvasir market`` and ``kvasir rewards`` when no ``--db`` is given.
DEFAULT_DB = "kvasir-market.db"
