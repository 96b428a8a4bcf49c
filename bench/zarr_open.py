"""What the Zarr store's prefix tree costs at open: a store bounded by ``max_bytes`` reads
each record's header at its first scan (storage/zarr/tree.py: one 144-byte ``pread``,
``O_NOATIME``, on the I/O threads), an unbounded one only lists the files (as every open
did before the tree).

Writes one local Zarr store of ``--records`` records (paths of 8 blocks with a snapshot at
their end, ``--payload`` bytes each), then opens it ``--rounds`` times each way,
interleaved (bounded, then unbounded: the baseline, in the same run), and prints the
median open time of each, their ratio, and the machine's load. The page cache is warm
(the files were just written and are listed by both): this is the cost of the header
reads' syscalls, not of a cold disk's seeks.

    python bench/zarr_open.py --records 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tiered_kv.storage import PutItem, RecordKey, ZarrStore, record_size

FP = "kvl1-bench-0123456789abcdef0123"


def items(n: int, payload: int) -> list[PutItem]:
    out: list[PutItem] = []
    body = bytes(payload)
    p = 0
    while len(out) < n:
        parent = hashlib.sha256(f"root{p}".encode()).digest()
        for i in range(8):
            h = hashlib.sha256(parent + f"{p}-{i}".encode()).digest()
            out.append(PutItem(RecordKey.block(h), parent_hash=parent, token_digest=h, payload=body))
            if i == 7:
                out.append(PutItem(RecordKey.snapshot(h), parent_hash=parent, token_digest=h, payload=body))
            parent = h
        p += 1
    return out[:n]


def open_s(where: Path, bound: int | None) -> tuple[float, int]:
    t0 = time.perf_counter()
    store = ZarrStore(where, layout_fingerprint=FP, max_bytes=bound)
    took = time.perf_counter() - t0
    linked = sum(1 for k in store._tree.oldest_first() if store._tree.parent_of(k) is not None)
    store.close()
    return took, linked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--payload", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="2,000 records, 2 rounds (make bench)")
    args = ap.parse_args()
    if args.quick:
        args.records, args.rounds = 2_000, 2
    with tempfile.TemporaryDirectory(prefix="zarr-open-", dir=args.dir) as tmp:
        where = Path(tmp) / "s"
        todo = items(args.records, args.payload)
        t0 = time.perf_counter()
        with ZarrStore(where, layout_fingerprint=FP) as store:
            for start in range(0, len(todo), 512):
                store.put_many(todo[start:start + 512])
        written = time.perf_counter() - t0
        bound = 2 * args.records * record_size(args.payload)  # (above the store: nothing evicted)
        bounded, plain = [], []
        linked = 0
        for _ in range(args.rounds):
            took, linked = open_s(where, bound)
            bounded.append(took)
            plain.append(open_s(where, None)[0])
    med_b, med_p = statistics.median(bounded), statistics.median(plain)
    out = {
        "records": args.records, "payload_bytes": args.payload, "rounds": args.rounds, "write_s": round(written, 2),
        "open_max_bytes_s": [round(x, 4) for x in bounded], "open_unbounded_s": [round(x, 4) for x in plain],
        "median_max_bytes_s": round(med_b, 4), "median_unbounded_s": round(med_p, 4),
        "ratio": round(med_b / med_p, 2), "linked_at_open": linked, "load": os.getloadavg(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"open of {args.records:,} records: with max_bytes (header reads) {med_b * 1000:.0f} ms, without "
          f"{med_p * 1000:.0f} ms (median of {args.rounds}), ratio {med_b / med_p:.2f}; "
          f"{linked:,} linked at open; load {out['load'][0]:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
