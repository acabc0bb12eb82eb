"""Tokens per second of the whole zephon_state pipeline against the bare ``tokenizers`` batch
encoder on the same documents with the same number of threads, on both corpora.

    python3 dev.py bench zephon_throughput [--parallelism 1 2 4] [--epochs 1.0] [--repeat 2]

Bare baseline: N threads take ~64 KiB chunks of the corpus from a shared list and call the
encoder on each (``TOKENIZERS_PARALLELISM=false``, so each call uses one core), counting
tokens; both ``encode_batch`` and ``encode_batch_fast`` (which the pipeline uses: it needs no
offsets) are measured. Pipeline: one source, GPT-2, ``wrap`` packing into 2048-token rows,
a 64-row shuffle window, microbatches of 8 rows; it is timed in steady state, after its first
window, over ``--epochs`` corpora worth of tokens delivered (as rows of input ids, EOS included:
one per document); "cold" also counts the start-up and the first window. Each figure is the
best of ``--repeat`` runs, taken in turns, because the machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from zephon_state import JsonLines, Pipeline, load_tokenizer  # noqa: E402
from zephon_state.storage import IoOptions  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "src" / "flextrain" / "corpus"
CHUNK_BYTES = 1 << 16


def chunks(texts: list[str]) -> list[list[str]]:
    out, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= CHUNK_BYTES:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def bare(texts: list[str], threads: int, method: str) -> tuple[int, float]:
    tok = load_tokenizer("gpt2").tokenizer
    encode = getattr(tok, method)
    work = chunks(texts)
    lock = threading.Lock()
    counts = [0] * threads

    def run(i: int) -> None:
        while True:
            with lock:
                if not work:
                    return
                chunk = work.pop(0)
            counts[i] += sum(len(e) for e in encode(chunk, add_special_tokens=False))

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts), time.perf_counter() - start


def pipeline(path: str, threads: int, tokens: int) -> tuple[float, float]:
    """(steady tokens/s, cold tokens/s) delivering ``tokens`` tokens."""
    start = time.perf_counter()
    p = Pipeline(path).tokenize(parallelism=threads).pack_flat(2048).shuffle(64, seed=0).batch(8)
    it = iter(p)
    first = next(it)
    warm = time.perf_counter()
    got = 0
    while got < tokens:
        got += next(it).input_ids.size
    end = time.perf_counter()
    p.close()
    return got / (end - warm), (got + first.input_ids.size) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores; TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")
    header = f"{'corpus':<14}{'threads':>8}{'encode_batch':>14}{'_fast':>12}{'pipeline':>12}{'cold':>12}{'vs batch':>10}{'vs fast':>9}"
    print(header)
    print("-" * len(header))
    for name in ("kjv", "python_stdlib"):
        path = str(CORPUS / f"{name}.jsonl.zst")
        texts = list(JsonLines(path).load("text", IoOptions(), "raise").texts)
        for n in args.parallelism:
            batch_rate = fast_rate = steady = cold = 0.0
            for _ in range(args.repeat):
                tokens, t_batch = bare(texts, n, "encode_batch")
                _, t_fast = bare(texts, n, "encode_batch_fast")
                run_steady, run_cold = pipeline(path, n, int(tokens * args.epochs))
                batch_rate, fast_rate = max(batch_rate, tokens / t_batch), max(fast_rate, tokens / t_fast)
                steady, cold = max(steady, run_steady), max(cold, run_cold)
            print(
                f"{name:<14}{n:>8}{batch_rate / 1e6:>12.2f} M{fast_rate / 1e6:>10.2f} M{steady / 1e6:>10.2f} M"
                f"{cold / 1e6:>10.2f} M{steady / batch_rate:>9.0%}{steady / fast_rate:>9.0%}",
                flush=True,
            )
    print("tokens/s in millions; ratios: pipeline (steady) / bare encoder with the same threads")


if __name__ == "__main__":
    main()
