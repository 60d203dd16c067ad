"""Two CPU processes (gloo DDP) through the real `mmlight` command: perplexity and BLEU computed over
both ranks' shares of a split equal a single-process run, and the hypotheses file is the same. The
training run and the single-process test run in the test's own process (``mmlight.cli.main``)."""

import json
from pathlib import Path

import pytest

from tests.helpers.ddp_probe import run_probed

ROOT = Path(__file__).resolve().parents[2]
NMT = ROOT / "configs" / "quickstart" / "nmt_multimax.yaml"


def mmlight(args: list[str], probe_dir: Path, cwd: Path, processes: int = 1) -> dict:
    """Run ``mmlight ARGS`` on ``processes`` processes with the probe callback; rank 0's record."""
    run_probed(args, probe_dir, cwd, processes)
    return json.loads((probe_dir / f"rank0-{args[0]}.json").read_text())


@pytest.mark.slow
def test_two_rank_bleu_perplexity_and_hypotheses_equal_one_rank(tmp_path):
    common = [
        "--config",
        str(NMT),
        "--data.init_args.cache_dir",
        str(tmp_path / "cache"),
        "--data.init_args.num_workers",
        "0",
        "--data.init_args.train_size",
        "2000",
        "--data.init_args.valid_size",
        "40",
        "--data.init_args.test_size",
        "37",
        "--data.init_args.max_tokens",
        "256",
        "--data.init_args.samples_per_shard",
        "10",
        "--model.init_args.beam.beam_size",
        "2",
    ]
    mmlight(  # no validation in the fit: nothing reads it, and its beam search would cost more than the steps
        [
            "fit",
            *common,
            "--trainer.max_steps",
            "30",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
        ],
        tmp_path / "fit",
        tmp_path,
    )
    checkpoint = next((tmp_path / "runs").rglob("last.ckpt"))
    records = {}
    for devices in (1, 2):
        out = tmp_path / f"out{devices}"
        records[devices] = mmlight(
            [
                "test",
                *common,
                "--ckpt_path",
                str(checkpoint),
                "--trainer.accelerator",
                "cpu",
                "--trainer.devices",
                str(devices),
                "--trainer.strategy",
                "ddp" if devices > 1 else "auto",
                "--trainer.logger",
                "false",
                "--model.init_args.output_dir",
                str(out),
            ],
            out,
            tmp_path,
            processes=devices,
        )
    one, two = records[1]["metrics"], records[2]["metrics"]
    assert two["test/tokens"] == one["test/tokens"]  # every target token counted once over the ranks
    for name in ("test/ppl", "test/loss", "test/bleu", "test/bleu_tok"):
        assert two[name] == pytest.approx(one[name], rel=1e-5), name
    hyps = [(tmp_path / f"out{d}" / "test.hyp").read_text().splitlines() for d in (1, 2)]
    assert len(hyps[0]) == 37 and hyps[0] == hyps[1]
