"""The persistent tier of serving lookups: a table's rows read from the export's .npy file
memory-mapped (deployment/serving/tiers/store.py's RowStore) against RocksDB (rocksdict, multi-get of
raw bytes values), for batches of power-law (Zipf) ids. One JSON line per store.

    python benchmarks/serving_store.py [--rows 4000000] [--dim 32] [--batch 4096] [--batches 200]

Needs `pip install rocksdict` (not in requirements.txt: the .npy store was kept, see
docs/benchmarks.md). The table (random rows) is written once under --work_dir as a .npy file and
a RocksDB database (keys: the id as 8 bytes big-endian; values: the row's float32 bytes), written
in write batches. Each lookup batch draws --batch ids with P(rank k) ~ (k + 1)^-alpha, the ranks
scattered over the table by a fixed permutation (hot rows are not neighbours on disk), and reads
the unique ones, sorted, into a [n, dim] float32 array; every batch is checked against the table.
Reported: unique rows per second (and batches per second) over --batches batches, after one pass
of warm-up batches (the page cache warm: the table fits in this machine's memory), or, with
--cold, after dropping the store's files from the page cache (the case of a table larger than
memory: rows read from the disk; RocksDB keeps its own small block cache).
"""
import argparse
import json
import mmap
import os
import sys
import time

import numpy as np


from dataloading.synthetic import power_law_ids  # noqa: E402


BLOCK = 1 << 16   # rows written at a time; the rows of a block are drawn from a generator seeded by its start


def table_rows(start: int, stop: int, dim: int) -> np.ndarray:
    """Rows [start, stop) of the benchmark table (a block, see BLOCK)."""
    return np.random.default_rng(start).standard_normal((stop - start, dim), np.float32)


def write_npy(path: str, rows: int, dim: int, block: int = BLOCK):
    with open(path + ".tmp", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
        for start in range(0, rows, block):
            f.write(table_rows(start, min(start + block, rows), dim).data)
    os.replace(path + ".tmp", path)


def write_rocksdb(path: str, rows: int, dim: int, block: int = BLOCK):
    import rocksdict
    options = rocksdict.Options(raw_mode=True)
    db = rocksdict.Rdict(path + ".tmp", options)
    for start in range(0, rows, block):
        values = table_rows(start, min(start + block, rows), dim)
        batch = rocksdict.WriteBatch(raw_mode=True)
        for i, row in zip(range(start, start + len(values)), values):
            batch.put(i.to_bytes(8, "big"), row.tobytes())
        db.write(batch)
    db.flush()
    db.close()
    os.replace(path + ".tmp", path)


def evict(path: str):
    """Drops the pages of file `path`, or of every file under directory `path`, from the page cache."""
    files = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def npy_reader(path: str):
    from deployment.serving.tiers import open_npy_table
    table = open_npy_table(path, writable=False)

    def read(ids):
        return table.read(ids)
    read.unmap = lambda: table._map.madvise(mmap.MADV_DONTNEED)   # mapped pages stay cached otherwise
    return read


def rocksdb_reader(path: str, dim: int):
    import rocksdict
    db = rocksdict.Rdict(path, rocksdict.Options(raw_mode=True))

    def read(ids):
        keys = ids.astype(">i8").view("V8").tolist()   # 8 bytes each ("S8" would strip trailing zeros)
        values = db.get(keys)
        return np.frombuffer(b"".join(values), np.float32).reshape(len(ids), dim)
    read.unmap = lambda: None
    return read


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096, help="ids per lookup batch (before deduplication)")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--work_dir", default="/tmp/serving_store_bench")
    parser.add_argument("--cold", action="store_true", help="drop the store's files from the page cache before "
                        "timing (posix_fadvise DONTNEED): rows come from the disk until cached again")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    stem = os.path.join(args.work_dir, f"table_{args.rows}x{args.dim}")
    for path, write in ((stem + ".npy", write_npy), (stem + ".rocksdb", write_rocksdb)):
        if not os.path.exists(path):
            t0 = time.perf_counter()
            write(path, args.rows, args.dim)
            print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rng = np.random.default_rng(0)
    scatter = rng.permutation(args.rows)
    batches = [np.unique(scatter[power_law_ids(rng.random(args.batch), args.rows, args.alpha)])
               for _ in range(2 * args.batches)]
    reference = np.load(stem + ".npy", mmap_mode="r")
    readers = (("npy_mmap", stem + ".npy", npy_reader(stem + ".npy")),
               ("rocksdb", stem + ".rocksdb", rocksdb_reader(stem + ".rocksdb", args.dim)))
    for name, path, read in readers:
        for ids in batches[:args.batches]:   # warm-up (also checks the values)
            if not np.array_equal(read(ids), reference[ids]):
                raise SystemExit(f"{name}: rows differ from the table")
        if args.cold:
            read.unmap()
            evict(path)
        t0 = time.perf_counter()
        for ids in batches[args.batches:]:
            read(ids)
        seconds = time.perf_counter() - t0
        rows = sum(len(ids) for ids in batches[args.batches:])
        print(json.dumps({"store": name, "cold": args.cold, "table_rows": args.rows, "dim": args.dim, "batch_ids": args.batch,
                          "unique_rows_per_batch": rows / args.batches,
                          "batches_per_s": round(args.batches / seconds, 1),
                          "rows_per_s": round(rows / seconds)}), flush=True)


if __name__ == "__main__":
    main()
