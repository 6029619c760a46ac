"""Memory of `data.streaming=true` over a large file: the process's RSS, sampled every second, while the stream reads
a generated JSONL file of about --gb GB (written to --dir, deleted afterwards).

Two passes, both through exp's own streaming classes (exp.data.streaming) with the tiny model's tokenizer:
1. `rows`: every row of the file through the reader and the seeded shuffle buffer (`RowStream`), no encoding: the
   whole file passes, so memory that grew with the file would show here.
2. `batches`: the training DataLoader of `StreamingDataModule` (rows -> encoding -> padded micro-batches), what
   `trainer.fit` draws from, for --batch-seconds seconds (encoding on the CPU is slower than reading; the model's
   forward and backward are left out: they hold the same memory at every step, whatever the file's size).

    python benchmarks/streaming_rss.py --gb 2 --out benchmarks/results/streaming_<date>

writes rss.csv (pass, seconds, rows or batches, MiB read, RSS MiB) and result.json (the command, the file, the RSS
at the start, the peak and the last sample of each pass) under --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

WORDS = "red blue green fox owl bee cat dog sun moon star tree river stone cloud wind leaf bird fish road".split()


def write_file(path: Path, target_bytes: int, seed: int = 0) -> int:
    """Alpaca rows of ~1 KB until the file reaches `target_bytes`; the number of rows."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(5000)]  # drawn from, for speed
    rows = 0
    with open(path, "w") as f:
        while f.tell() < target_bytes:
            lines = []
            for _ in range(1000):
                text = f"{rows} {rng.choice(texts)}"
                lines.append(json.dumps({"instruction": "Repeat the words.", "input": text, "output": text[:200]}))
                rows += 1
            f.write("\n".join(lines) + "\n")
    return rows


def rss_mib() -> float:
    """This process's resident set size (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Sampler(threading.Thread):
    """RSS of this process every `every` seconds, with the pass and its progress at that moment."""

    def __init__(self, every: float = 1.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.stage, self.progress = every, [], "start", (0, 0.0)
        self.t0, self.stopped = time.time(), threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            count, mib = self.progress
            rss = rss_mib()
            self.samples.append((self.stage, round(time.time() - self.t0, 1), count, round(mib, 1), round(rss, 1)))
            self.stopped.wait(self.every)


def summary(samples: list, stage: str) -> dict:
    rss = [s[4] for s in samples if s[0] == stage]
    if not rss:
        return {}
    return {"first_mib": rss[0], "peak_mib": max(rss), "last_mib": rss[-1], "samples": len(rss)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--batch-seconds", type=float, default=120.0)
    ap.add_argument("--max-seconds", type=float, default=540.0, help="stop the rows pass here (the file unfinished)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from exp.core.config import DataConfig, DataFormat
    from exp.data.streaming import RowStream, StreamingDataModule
    from exp.model.build import build_tokenizer
    from exp.run.compose import compose_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.dir) / f"exp-streaming-rss-{os.getpid()}"
    work.mkdir()
    try:
        data = work / "big.jsonl"
        t = time.time()
        n_rows = write_file(data, int(args.gb * 1e9))
        size = data.stat().st_size
        print(f"wrote {n_rows} rows, {size / 1e9:.2f} GB in {time.time() - t:.0f} s", flush=True)
        tokenizer = build_tokenizer(compose_config([]).model)
        sampler = Sampler()
        sampler.start()

        # Pass 1: every row through the reader and the shuffle buffer.
        sampler.stage = "rows"
        rows = RowStream([data], 0, 1000, seed=0)
        t0, n, read = time.time(), 0, 0
        while rows.epoch == 0 and time.time() - t0 < args.max_seconds:
            _, row = rows.next_row()
            n += 1
            read += len(row["input"]) + len(row["output"]) + 60  # about the row's bytes on disk
            if n % 10_000 == 0:
                sampler.progress = (n, read / 2**20)
        whole = rows.epoch > 0  # the last row read then is the next epoch's first
        rows_done = {"rows": n - whole, "seconds": round(time.time() - t0, 1), "whole_file": whole}
        print(f"rows pass: {rows_done}", flush=True)

        # Pass 2: the training DataLoader (encoding, padded micro-batches of 8 at max_seq_len 512).
        sampler.stage, sampler.progress = "batches", (0, 0.0)
        cfg = DataConfig(
            format=DataFormat.alpaca, path=str(data), streaming=True, val_size=100, max_seq_len=512, shuffle_buffer=1000
        )
        dm = StreamingDataModule(cfg, tokenizer, micro_batch_size=8)
        t0, b = time.time(), 0
        for _batch in dm.train_dataloader():
            b += 1
            if b % 10 == 0:
                sampler.progress = (b, 0.0)
            if time.time() - t0 > args.batch_seconds:
                break
        batches_done = {"batches": b, "examples": b * 8, "seconds": round(time.time() - t0, 1)}
        print(f"batches pass: {batches_done}", flush=True)
        sampler.stopped.set()
        sampler.join()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    with open(out / "rss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pass", "seconds", "rows_or_batches", "mib_read", "rss_mib"])
        w.writerows(sampler.samples)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "file": {"rows": n_rows, "bytes": size},
        "rss_before_mib": summary(sampler.samples, "rows").get("first_mib"),
        "rows_pass": {**rows_done, **summary(sampler.samples, "rows")},
        "batches_pass": {**batches_done, **summary(sampler.samples, "batches")},
        "cpus": os.cpu_count(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
