"""The market's ledger at size: how long a status's totals take, and how big the file gets.

    python bench/ledger.py [--events 10000,100000,1000000] [--keep 100000] [--save]

For each size: that many one-row wins (3 nodes x 48 layers x 128 experts, as a busy swarm records
them, in batches of 5,000 with their routing) are applied as the market applies them, folding
after each batch as the market does every few seconds (``--keep``), then the totals a status
reads are timed (median of 20), beside the same totals computed the way a ledger without running
totals must (a GROUP BY over every event, on a second file that is never folded). Prints one
JSON object; ``--save`` writes it to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import record  # noqa: E402
from kvasir_bus import market_codec as mc  # noqa: E402
from market.ledger import Ledger  # noqa: E402

FP = "0123456789abcdef"
NODES = ("w-1", "w-2", "w-3")
BATCH = 5000


def fill(led: Ledger, n: int, keep: int | None) -> None:
    for start in range(0, n, BATCH):
        events = [mc.LedgerEvent(f"e{i}", NODES[i % 3], i % 48, (i // 48) % 128, 1, float(i))
                  for i in range(start, min(n, start + BATCH))]
        remote: dict[tuple[int, int], int] = {}
        for e in events:
            remote[(e.layer, e.expert)] = remote.get((e.layer, e.expert), 0) + 1
        led.apply_routing("S", 2 * start, FP, "bb", [(la, ex, r) for (la, ex), r in remote.items()], f"r{start}")
        led.apply_batch("S", 2 * start + 1, FP, "bb", f"b{start}", [(e, 0.5) for e in events], float(start))
        if keep is not None:
            led.fold(before=-1.0, keep=keep)


def median_ms(fn, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/ledger.py --events 100000,1000000 --save")
    ap.add_argument("--events", default="10000,100000,1000000", metavar="N[,N...]")
    ap.add_argument("--keep", type=int, default=100_000, metavar="N", help="the market's --keep-events")
    record.add_save_flag(ap)
    args = ap.parse_args()
    sizes = [int(x) for x in args.events.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvasir-ledger-") as tmp:
        for n in sizes:
            print(f"ledger of {n} events ...", file=sys.stderr, flush=True)
            folded_path, raw_path = Path(tmp) / f"f{n}.db", Path(tmp) / f"r{n}.db"
            with Ledger(folded_path) as led:
                fill(led, n, args.keep)
                led._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                ours = median_ms(lambda: led.totals(FP))
                kept = led._db.execute("SELECT count(*) FROM events").fetchone()[0]
            with Ledger(raw_path) as led:
                fill(led, n, None)
                led._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                scan = median_ms(lambda: led._db.execute(
                    "SELECT node, count(*), sum(rows), sum(reward) FROM events WHERE model = ? AND void = 0 "
                    "GROUP BY node ORDER BY node", (FP,)).fetchall())
            rows.append({"events": n, "kept_events": kept, "totals_ms": ours, "scan_totals_ms": scan,
                         "file_mb": round(folded_path.stat().st_size / 2**20, 2),
                         "unfolded_file_mb": round(raw_path.stat().st_size / 2**20, 2)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"bench": "ledger", "keep_events": args.keep, "sizes": rows}
    print(json.dumps(result))
    record.save(args, "ledger", result)


if __name__ == "__main__":
    main()
