"""`planaria data prepare` against the `tokenizers` library called directly, on the same files.

    python benchmarks/data_prepare.py [--mb 16] [--repeats 3] [--workers 1,2] [--rss-mb 256] [--json out.json]

The corpus is the standard library's `.py` files, copied over and over into a temporary
directory until it holds `--mb` MiB (each copy of a file is a document). A byte-level BPE
of 4096 tokens is trained first on one copy (`planaria data prepare --train-bpe`, not
timed). Then, in alternating order, `--repeats` times:

  direct     one process reads the files in the same groups as prepare's units and calls
             `Tokenizer.encode_batch_fast` on them, in prepare's batches of ~1M characters
             (the library's own thread pool over all cores): the tokenizer's throughput
             with nothing around it (the +1 per document counts the end-of-text id);
  prepare W  `planaria data prepare --workers W` in a fresh process: the same encoding, plus
             the validation hash of each document, the ids as numpy arrays, the shards
             written (fsync'd) with their checksums, the journal, and the manifest.

Reported: the median tokens/s of each, the ratio prepare / direct, and the peak resident
memory of prepare (the sum over its process tree, sampled every 0.1 s from /proc), with
the load of the machine while it ran. Then, once, prepare with the most workers on a
corpus of `--rss-mb` MiB: its peak memory there (bounded by a shard's buffer and the
units in flight, not by the corpus) and its rate. 0 skips it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path


from planaria.runtime.data import prepare as prep
from planaria.runtime.data import shards
from planaria.runtime.data.corpus import discover
from planaria.runtime.data.token_datasets import _stdlib_files


def make_corpus(root: Path, mib: int) -> int:
    """Copies of the standard library's .py files under `root` until `mib` MiB; returns bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [(p, p.read_bytes()) for p in _stdlib_files(stdlib)]
    total, copy = 0, 0
    while total < mib << 20:
        for path, data in files:
            target = root / f"copy{copy:03d}" / path.relative_to(stdlib)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            total += len(data)
            if total >= mib << 20:
                break
        copy += 1
    return total


def direct(corpus: Path, tokenizer_path: Path) -> tuple[int, float]:
    """(tokens, seconds) of the tokenizers library alone over prepare's units."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    units = discover([str(corpus)], "text")
    started = time.perf_counter()
    n = 0
    for unit in units:
        texts = [Path(p).read_bytes().decode("utf-8", errors="replace") for p in unit.paths]
        for batch in prep._batches(texts, prep.ENCODE_BATCH_CHARS):  # prepare's batches, for a like comparison
            n += sum(len(e.ids) + 1 for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
    return n, time.perf_counter() - started


def _tree_rss(root_pid: int) -> int:
    """Resident bytes of a process and its descendants, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        kids = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(kids)
        frontier += kids
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_prepare(corpus: Path, tokenizer_path: Path, out: Path, workers: int) -> tuple[int, float, int]:
    """(tokens, seconds, peak tree RSS bytes) of `planaria data prepare` in a fresh process."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "planaria.cli", "data", "prepare", str(corpus), "--out", str(out),
           "--tokenizer", str(tokenizer_path), "--workers", str(workers), "--quiet"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    elapsed = time.perf_counter() - started
    stop.set()
    sampler.join()
    if rc:
        raise SystemExit(f"planaria data prepare failed ({rc})")
    manifest = shards.read_manifest(out)
    n = sum(e["tokens"] for split in manifest["splits"].values() for e in split)
    return n, elapsed, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=16, help="corpus size in MiB for the rates")
    parser.add_argument("--rss-mb", type=int, default=256, help="corpus size in MiB for the peak memory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2", help="comma-separated --workers values of prepare")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="planaria-prepare-bench-") as tmp:
        tmp = Path(tmp)
        size = make_corpus(tmp / "corpus", args.mb)
        print(f"corpus: {size / 2**20:.0f} MiB of standard-library source, "
              f"{sum(1 for _ in (tmp / 'corpus').rglob('*.py')):,} files")
        one_copy = tmp / "corpus" / "copy000"
        subprocess.run([sys.executable, "-m", "planaria.cli", "data", "prepare", str(one_copy), "--out",
                        str(tmp / "tok"), "--train-bpe", "4096", "--quiet", "--val-fraction", "0"], check=True)
        tokenizer_path = tmp / "tok" / "tokenizer.json"
        rates: dict[str, list[float]] = {"direct": [], **{f"prepare w{w}": [] for w in workers}}
        peaks: dict[str, list[int]] = {f"prepare w{w}": [] for w in workers}
        tokens = {}
        load_before = os.getloadavg()[0]
        for r in range(args.repeats):
            order = ["direct", *peaks] if r % 2 == 0 else [*reversed(list(peaks)), "direct"]
            for name in order:
                if name == "direct":
                    n, seconds = direct(tmp / "corpus", tokenizer_path)
                else:
                    n, seconds, peak = run_prepare(tmp / "corpus", tokenizer_path, tmp / "out", int(name[9:]))
                    peaks[name].append(peak)
                tokens[name] = n
                rates[name].append(n / seconds)
                print(f"  round {r + 1} {name:>11}: {n:,} tokens in {seconds:.1f} s ({n / seconds:,.0f} tokens/s)",
                      flush=True)
        load_after = os.getloadavg()[0]
        big = None
        if args.rss_mb:
            shutil.rmtree(tmp / "out", ignore_errors=True)
            big_size = make_corpus(tmp / "big", args.rss_mb)
            n, seconds, peak = run_prepare(tmp / "big", tokenizer_path, tmp / "out", max(workers))
            big = {"mib": big_size / 2**20, "tokens": n, "seconds": seconds, "peak": peak}
    base = statistics.median(rates["direct"])
    print(f"\n{'':>12} {'tokens/s (median)':>18} {'/ direct':>9} {'peak RSS':>10}")
    print(f"{'direct':>12} {base:>18,.0f} {1.0:>9.2f} {'':>10}")
    for name in peaks:
        rate = statistics.median(rates[name])
        print(f"{name:>12} {rate:>18,.0f} {rate / base:>9.2f} {statistics.median(peaks[name]) / 2**20:>7.0f} MiB")
    print(f"cores {os.cpu_count()}, load average {load_before:.1f} before and {load_after:.1f} after")
    if big:
        print(f"\nprepare --workers {max(workers)} on {big['mib']:.0f} MiB: {big['tokens']:,} tokens in "
              f"{big['seconds']:.0f} s ({big['tokens'] / big['seconds']:,.0f} tokens/s), peak RSS "
              f"{big['peak'] / 2**20:.0f} MiB (all processes)")
    assert len({tokens[name] for name in tokens}) == 1, f"token counts differ: {tokens}"
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mb, "rates": rates, "peaks": peaks, "tokens": tokens,
                                               "big": big}))


if __name__ == "__main__":
    main()
