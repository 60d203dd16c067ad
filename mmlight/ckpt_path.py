"""What ``--ckpt_path`` names: a file checked before any work, or ``last``, resolved to this run's newest
resume point."""

from __future__ import annotations

from pathlib import Path

#: ``--ckpt_path`` values that Lightning resolves itself
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


def check_checkpoint_file(path: str | None) -> None:
    """Stop before any work when ``--ckpt_path`` names a local file that is missing or is not a
    Lightning checkpoint (torch.load would fail later with e.g. "Unsupported operand 103"). Special
    values (``last``, ``best``, ...) and remote URLs are left to Lightning."""
    if not path or path in SPECIAL_CKPT_PATHS or path.startswith("registry:") or "://" in path:
        return
    import torch

    if not Path(path).is_file():
        raise SystemExit(f"mmlight: --ckpt_path {path}: no such file")
    try:  # memory-mapped: the tensors are not read
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # anything torch.load raises on a file it cannot read
        reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        raise SystemExit(
            f"mmlight: --ckpt_path {path} is not a Lightning checkpoint (torch.load cannot read it: {reason})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise SystemExit(
            f"mmlight: --ckpt_path {path} is not a Lightning checkpoint "
            "(a torch file without the 'state_dict' entry Lightning writes)"
        )


def newest_checkpoint(trainer) -> str | None:
    """The most recently written resume point of this run, or None.

    With a logger, that is any ``last*.ckpt`` or ``hpc_ckpt_*.ckpt`` under the run's name (every
    version; under SLURM the trainer's root directory is one of them), plus the ``hpc_ckpt_*.ckpt``
    that Lightning writes directly into the root directory. Only without a logger is the root
    directory searched recursively: it defaults to the working directory, where other runs'
    checkpoints may live.
    """
    root = Path(trainer.default_root_dir)
    patterns = ("**/last*.ckpt", "**/hpc_ckpt_*.ckpt")
    if trainer.logger is not None and trainer.logger.log_dir is not None:
        searches = [(Path(trainer.logger.log_dir).parent, patterns), (root, ("hpc_ckpt_*.ckpt",))]
    else:
        searches = [(root, patterns)]
    found = {p for folder, globs in searches if folder.is_dir() for pattern in globs for p in folder.glob(pattern)}
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None
