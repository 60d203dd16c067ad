"""``mmlight export hf``: a Llama-style language-model checkpoint as a Hugging Face ``transformers`` model
folder (``config.json``, ``model.safetensors``) that ``from_pretrained`` loads.

::

    mmlight export hf --ckpt_path runs/llm_softmax/version_0/checkpoints/last.ckpt --out exported/llm_softmax

What can and cannot be exported, and how to load a function other than softmax: :mod:`mmlight.export.hf`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mmlight export", description="export a checkpoint to another ecosystem")
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    hf = formats.add_parser(
        "hf",
        help="a transformers model folder (LlamaForCausalLM, or Qwen3ForCausalLM with qk_norm)",
        description="Write a Llama-style LanguageModel checkpoint as a transformers model folder.",
    )
    hf.add_argument("--ckpt_path", type=Path, required=True, help="the LanguageModel checkpoint (.ckpt)")
    hf.add_argument("--out", type=Path, required=True, help="the folder to write (created; files in it are replaced)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    """Entry point of ``mmlight export``: a checkpoint that is not there, not a language model or not
    Llama-style ends with one line naming why, before anything is written."""
    args = parse_args(argv)
    if not args.ckpt_path.is_file():
        raise SystemExit(f"mmlight export: error: checkpoint {args.ckpt_path} does not exist")
    from mmlight.export.hf import NotExportable, export
    from mmlight.tasks import LanguageModel

    try:
        task = LanguageModel.load_from_checkpoint(args.ckpt_path, map_location="cpu")
    except Exception as err:  # another task's checkpoint (a translator, a classifier): say which file and why
        raise SystemExit(f"mmlight export: error: {args.ckpt_path} is not a LanguageModel checkpoint: {err}") from err
    try:
        out = export(task.model, args.out)
    except NotExportable as err:
        raise SystemExit(f"mmlight export: error: {args.ckpt_path}: {err}") from err
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
