"""Every paper and quick-start config builds the same network as before the Llama-style options existed:
a forward of each config's architecture (its own widths, depths, norms, positions, reweighting; only the
vocabulary shrunk to 40 tokens) at a fixed seed, in float64, gives the logits pinned in
``pinned_forwards.json`` to within 1e-9, and the parameters keep their names and shapes (so checkpoints
still load).

In float64, not float32: the same float32 matmul and softmax give other last bits on another CPU (torch
picks its kernels by the instruction set; between two AMD EPYC machines the float32 logits of the softmax
and MultiMax configs differed by up to 1.3e-6), which a tolerance wide enough for that would let a small
change through (a norm epsilon of 1e-6 for 1e-5 moves them by about 1e-5). In float64 the machines agree
to about 1e-15, and such a change is 1e4 times the tolerance.

The pinned values were computed on the code before the Llama-style options existed (commit 8afe1b7);
regenerate them only for a deliberate change of an existing architecture:
``PYTHONPATH=$PWD python tests/models/test_pinned_forwards.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from mmlight.models.transformer import TransformerConfig, TransformerLM, TransformerSeq2Seq
from mmlight.reweighting import ReweightingSpec

ROOT = Path(__file__).resolve().parents[2]
PINNED = Path(__file__).with_name("pinned_forwards.json")
CONFIGS = sorted(
    [
        *(ROOT / "configs").glob("lm_wikitext103_*.yaml"),
        *(ROOT / "configs").glob("nmt_iwslt14_*.yaml"),
        *(ROOT / "configs" / "quickstart").glob("lm_*.yaml"),
        *(ROOT / "configs" / "quickstart").glob("nmt_*.yaml"),
    ]
)
VOCAB = 40
#: the torch the values were pinned with: its initialisation draws the weights; another release may draw
#: other ones from the same seed (torch 2.9.1 does), so the check runs under this release only
PINNED_TORCH = "2.14.1"
SAMPLED = 16  # logits recorded, spread over both rows (the padded one too) and every position


def config_of(path: Path) -> TransformerConfig:
    """The config's network as a ``TransformerConfig``, with a ``VOCAB``-token vocabulary."""
    fields = dict(yaml.safe_load(path.read_text())["model"]["init_args"]["model"])
    fields["attention"] = ReweightingSpec(**fields.get("attention", {}))
    return TransformerConfig(vocab_size=VOCAB, **fields)


@contextmanager
def one_thread():
    """One intra-op thread, so that the sums of a matmul run in one order whatever the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def forward(path: Path) -> dict:
    """Logits of the config's network (seed 0, evaluation mode, float64) on fixed tokens with padding."""
    config = config_of(path)
    torch.manual_seed(0)  # the float32 initialisation, then float64 copies of those weights
    model = (TransformerSeq2Seq if config.n_encoder_layers else TransformerLM)(config).double().eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, VOCAB, (2, 12), generator=g)
    tokens[1, 9:] = config.pad_id  # a padded row: the key-padding path
    with torch.no_grad(), one_thread():
        if config.n_encoder_layers:
            src = torch.randint(4, VOCAB, (2, 10), generator=g)
            src[0, 7:] = config.pad_id
            logits = model.logits(model(src, tokens))
        else:
            logits = model.logits(model(tokens))  # (2, 12, VOCAB)
    flat = logits.flatten()
    picks = torch.linspace(0, flat.numel() - 1, SAMPLED).long()
    params = [f"{name}:{tuple(p.shape)}" for name, p in model.state_dict().items()]
    return {
        "sampled": [float(flat[i]).hex() for i in picks],
        "parameters": hashlib.sha256("\n".join(params).encode()).hexdigest(),
    }


def pinned() -> dict:
    return json.loads(PINNED.read_text())


def test_every_config_is_pinned():
    assert sorted(pinned()) == [str(p.relative_to(ROOT)) for p in CONFIGS]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_forward_is_the_pinned_one(path):
    if torch.__version__.split("+")[0] != PINNED_TORCH:
        pytest.skip(f"pinned with torch {PINNED_TORCH}, whose seeded initialisation draws these weights")
    want, got = pinned()[str(path.relative_to(ROOT))], forward(path)
    assert got["parameters"] == want["parameters"], "parameter names or shapes changed"
    sampled = (torch.tensor([float.fromhex(x) for x in d["sampled"]], dtype=torch.float64) for d in (got, want))
    torch.testing.assert_close(*sampled, rtol=1e-9, atol=1e-12)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    PINNED.write_text(json.dumps({str(p.relative_to(ROOT)): forward(p) for p in CONFIGS}, indent=1) + "\n")
    print(f"wrote {PINNED}")
