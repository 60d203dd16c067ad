"""Tiny WikiText-103 and IWSLT14 shard sets, written from the raw-format fixtures of the data tests by
the real preparers; shared by the CLI and SLURM tests."""

import json
from pathlib import Path


def write_text_shard_sets(root: Path) -> dict[str, Path]:
    """``{"wikitext103": shards, "iwslt14": shards}`` under ``root``."""
    from mmlight.data.prepare.iwslt import prepare_iwslt
    from mmlight.data.prepare.wikitext import prepare
    from tests.helpers.iwslt import write_raw as write_iwslt
    from tests.helpers.wikitext import write_raw as write_wikitext

    prepare(write_wikitext(root / "wikitext_raw"), root / "wikitext103", workers=1)
    write_iwslt(root / "iwslt_raw")
    prepare_iwslt(root / "iwslt_raw", root / "iwslt14", workers=1, merges=50, samples_per_shard=4)
    return {"wikitext103": root / "wikitext103", "iwslt14": root / "iwslt14"}


def vocab_size(shards: Path) -> int:
    return int(json.loads((shards / "_info.json").read_text())["vocab"]["size"])


# Overrides that fit the Table 3/4 configs' batches to the fixtures (a handful of sentences).
FIXTURE_BATCHES = {
    "wikitext103": [
        "--data.init_args.block_size",
        "8",
        "--data.init_args.batch_size",
        "2",
        "--data.init_args.eval_block_size",
        "8",
        "--data.init_args.eval_context",
        "4",
    ],
    "iwslt14": ["--data.init_args.max_tokens", "64"],
}


def python_docs_shards(root: Path) -> Path:
    """A small python-docs shard set (the llm quick starts' data) under ``root``: the pydoc help topics and
    one made-up module, a 300-token BPE; returns the shard folder."""
    from mmlight.data.prepare import python_docs

    (root / "stdlib").mkdir(parents=True)
    (root / "stdlib" / "mod.py").write_text('"""A module."""\n', encoding="utf-8")
    python_docs.prepare(None, root / "shards", 1, stdlib=root / "stdlib", vocab_size=300, valid_fraction=0.1)
    return root / "shards"
