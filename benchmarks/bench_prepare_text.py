"""Tokens per second per core of ``mmlight prepare text`` beside Hugging Face ``tokenizers`` alone on the
same text.

The text is the ``python-docs`` corpus (``pydoc_data`` topics and the standard library's docstrings of
the running Python; no download), written once as jsonl; a byte-level BPE of ``--vocab-size`` tokens is
trained on it once (that time is recorded, not compared). Each round then, side by side, on one thread:

* ``encode_batch`` and ``encode_batch_fast`` of ``tokenizers`` on the documents already in memory;
* ``mmlight.data.prepare.text.prepare(..., workers=1, tokenizer=...)`` into a fresh folder: reading the
  jsonl, the split hash, the same ``encode_batch_fast`` calls, the token arrays, the shards with their
  checksums and ``_info.json`` (the tokenizer given, so no training).

The record gives every round's seconds, the median tokens/s of each and the ratio of the preparation's
to ``encode_batch``'s::

    python benchmarks/bench_prepare_text.py            # writes benchmarks/results/prepare_text-cpu-...json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers
from record_name import cpu_description, record_path  # beside this script, which Python puts on sys.path

from mmlight.data.prepare import python_docs, text


def corpus(folder: Path) -> tuple[Path, list[str]]:
    """The python-docs corpus as jsonl, and its documents."""
    path = folder / "python-docs.jsonl"
    python_docs.write_corpus(path)
    return path, [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="side-by-side rounds")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the BPE's tokens")
    parser.add_argument("--out", type=Path, help="record file (default: benchmarks/results/prepare_text-cpu-...)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        source, docs = corpus(folder)
        train_s, hf_json = timed(lambda: text.train_tokenizer(iter([docs]), args.vocab_size))
        (folder / "tokenizer.json").write_text(hf_json, encoding="utf-8")
        tokenizer = tokenizers.Tokenizer.from_str(hf_json)
        rounds = []
        with text.single_threaded():
            for r in range(args.rounds):
                batch_s, encodings = timed(lambda: tokenizer.encode_batch(docs, add_special_tokens=False))
                fast_s, _ = timed(lambda: tokenizer.encode_batch_fast(docs, add_special_tokens=False))
                out = folder / f"round{r}"
                prepare_s, info = timed(
                    lambda: text.prepare([source], out, 1, tokenizer=folder / "tokenizer.json", valid_fraction=0.01)
                )
                rounds.append({"encode_batch_s": batch_s, "encode_batch_fast_s": fast_s, "prepare_s": prepare_s})
        tokens = sum(len(e.ids) for e in encodings)
        prepared = sum(s["num_tokens"] for s in info["splits"].values())
        assert prepared == tokens + len(docs), (prepared, tokens)  # every document's ids and its </s>
    rates = {k.removesuffix("_s"): statistics.median(tokens / r[k] for r in rounds) for k in rounds[0]}
    record = {
        "benchmark": "prepare_text",
        "machine": cpu_description(),
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "documents": len(docs),
        "bytes": sum(len(d.encode("utf-8")) for d in docs),
        "tokens": tokens,
        "vocab_size": args.vocab_size,
        "train_tokenizer_s": train_s,
        "rounds": rounds,
        "median_tokens_per_s": rates,
        "ratio_prepare_over_encode_batch": statistics.median(r["encode_batch_s"] / r["prepare_s"] for r in rounds),
        "load_average_1_5_15_min": list(os.getloadavg()),
    }
    path = args.out or record_path("prepare_text", "cpu", [("tokenizers", tokenizers.__version__)], "json", tag="")
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{path}: {json.dumps(rates)}; prepare / encode_batch {record['ratio_prepare_over_encode_batch']:.2f}")


if __name__ == "__main__":
    main()
