"""Preparing a parquet corpus: gridtrain data prepare's throughput beside datasets.map with the same
tokenizer and worker count, and prepare's peak RSS for a corpus 1x and 4x the size.

    python bench/bench_prepare.py [--mb 24] [--workers 2] [--vocab 8192] [--skip-datasets]

The corpus: the running interpreter's standard library source, one document per file, in parquet
files of 512 rows (--mb megabytes of text), and a BPE tokenizer.json of --vocab trained on it once.
1. Throughput: `prepare(..., workers=W)` against `datasets.load_dataset("parquet").map(tokenize,
   batched=True, num_proc=W)` that tokenizes with the same tokenizers.Tokenizer (no eos, no shards:
   the map alone, its arrow cache in a temporary folder; loading, i.e. copying the parquet into
   datasets' arrow cache, timed apart). Documents/s and tokens/s, best of --reps.
2. Peak RSS: the same prepare in a fresh process on the corpus and on 4 copies of it (4x the
   documents, tokens and shards): the preparing process's high-water mark, and the largest sum of
   its and its workers' resident sets (`peak_rss`). Flat means the 4x corpus needs no more memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.data.corpus import default_corpus, iter_documents  # noqa: E402

ROWS_PER_FILE = 512


def make_corpus(folder: Path, megabytes: float) -> int:
    """Parquet files of the standard library's text, about `megabytes` of it; returns the documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    rows, size, files, total = [], 0, 0, 0
    for text in iter_documents(default_corpus()):
        rows.append(text)
        size += len(text.encode())
        if len(rows) == ROWS_PER_FILE or size >= megabytes * 1e6:
            pq.write_table(pa.table({"text": rows}), folder / f"part-{files:04d}.parquet")
            files, total, rows = files + 1, total + len(rows), []
        if size >= megabytes * 1e6:
            break
    if rows:
        pq.write_table(pa.table({"text": rows}), folder / f"part-{files:04d}.parquet")
        total += len(rows)
    return total


def time_prepare(corpus: Path, tokenizer_json: Path, workers: int, work: Path) -> tuple[float, int, int]:
    from gridtrain.data.shards import load_index, prepare
    from gridtrain.data.tokenizer import BPETokenizer

    out = work / f"prepared-{time.perf_counter_ns()}"
    start = time.perf_counter()
    prepare(corpus, BPETokenizer.load(tokenizer_json), out, workers=workers)
    seconds = time.perf_counter() - start
    index = load_index(out)
    shutil.rmtree(out)
    return seconds, index["num_docs"] + index["empty_docs"], index["num_tokens"]


def time_datasets_map(corpus: Path, tokenizer_json: Path, workers: int, work: Path) -> tuple[float, float, int]:
    """(seconds to load the parquet into datasets' cache, seconds of the map, tokens)."""
    import datasets

    datasets.disable_progress_bars()
    cache = work / f"hf-cache-{time.perf_counter_ns()}"
    start = time.perf_counter()
    ds = datasets.load_dataset("parquet", data_files=sorted(str(p) for p in corpus.glob("*.parquet")),
                               split="train", cache_dir=str(cache))
    loaded = time.perf_counter()
    mapped = ds.map(_hf_tokenize, batched=True, num_proc=workers if workers > 1 else None,
                    fn_kwargs={"path": str(tokenizer_json)}, remove_columns=["text"])
    seconds = time.perf_counter() - loaded
    tokens = sum(len(ids) for ids in mapped["ids"])
    shutil.rmtree(cache, ignore_errors=True)
    return loaded - start, seconds, tokens


_HF: dict[str, object] = {}


def _hf_tokenize(batch: dict[str, list[str]], path: str) -> dict[str, list[list[int]]]:
    from tokenizers import Tokenizer

    tok = _HF.get(path) or _HF.setdefault(path, Tokenizer.from_file(path))
    return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}


def peak_rss(corpus: Path, tokenizer_json: Path, workers: int, work: Path) -> dict[str, float]:
    """Peak RSS (MiB) of a fresh process preparing `corpus`: its own high-water mark (VmHWM), and the
    largest sum of its and its workers' resident sets, sampled every 20 ms from /proc. (getrusage's
    ru_maxrss is no use here: a child starts from its parent's high-water mark.)"""
    code = (f"import sys, pathlib; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
            "from gridtrain.data.prepare import prepare\nfrom gridtrain.data.tokenizer import BPETokenizer\n"
            f"prepare({str(corpus)!r}, BPETokenizer.load({str(tokenizer_json)!r}), "
            f"pathlib.Path({str(work / 'rss-out')!r}), workers={workers})\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    tree = 0
    while proc.poll() is None:
        tree = max(tree, sum(_rss_kib(pid) for pid in [proc.pid, *_children(proc.pid)]))
        time.sleep(0.02)
    assert proc.returncode == 0, "the prepare failed"
    shutil.rmtree(work / "rss-out")
    return {"main_MiB": int(proc.stdout.read().split()[-1]) / 1024, "tree_MiB": tree / 1024}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rss_kib(pid: int) -> int:
    try:
        line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=24.0, help="megabytes of text in the 1x corpus")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-datasets", action="store_true")
    args = parser.parse_args()
    from gridtrain.data.tokenizer import BPETokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs = make_corpus(work / "x1", args.mb)
        tokenizer_json = work / "tokenizer.json"
        BPETokenizer.train(iter_documents(work / "x1"), args.vocab, save_path=tokenizer_json)
        print(f"corpus: {docs:,} documents, {args.mb:g} MB of text in {len(list((work / 'x1').iterdir()))} parquet "
              f"files; BPE of {args.vocab:,} tokens; {args.workers} workers; this machine has {os.cpu_count()} CPUs")
        best = min(time_prepare(work / "x1", tokenizer_json, args.workers, work) for _ in range(args.reps))
        seconds, documents, tokens = best
        print(f"gridtrain prepare:  {seconds:6.2f} s  {documents / seconds:10,.0f} documents/s  "
              f"{tokens / seconds:12,.0f} tokens/s  (shards and manifest written)")
        if not args.skip_datasets:
            load, mapped, hf_tokens = min(time_datasets_map(work / "x1", tokenizer_json, args.workers, work)
                                          for _ in range(args.reps))
            print(f"datasets.map:       {mapped:6.2f} s  {docs / mapped:10,.0f} documents/s  {hf_tokens / mapped:12,.0f} "
                  f"tokens/s  (map alone; load_dataset's copy into its cache {load:.2f} s more)")
        (work / "x4").mkdir()
        for copy in range(4):
            for f in sorted((work / "x1").glob("*.parquet")):
                os.link(f, work / "x4" / f"c{copy}-{f.name}")
        for name in ("x1", "x4"):
            rss = peak_rss(work / name, tokenizer_json, args.workers, work)
            print(f"peak RSS, corpus {name}: preparing process {rss['main_MiB']:7.1f} MiB, with its workers "
                  f"{rss['tree_MiB']:7.1f} MiB")


if __name__ == "__main__":
    main()
