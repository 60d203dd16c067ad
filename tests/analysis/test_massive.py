"""Massive activations: a planted entry is found at its block, sample, position, token and dimension with
its ratio to the sample's median; the per-block means against a recomputation in float64; padding is
never reported."""

import numpy as np
import pytest
import torch

from mmlight.analysis.massive import MassiveSettings, massive_activations, massive_rows
from mmlight.models.transformer import LLAMA_STYLE
from mmlight.tasks import LanguageModel
from tests.helpers.models import tiny_transformer

PAD = 1


#: a Llama-style decoder (rotary positions, RMSNorm, SwiGLU, 4 query heads over 2 key/value heads)
LLAMA = {**LLAMA_STYLE, "n_heads": 4, "n_kv_heads": 2}


def tiny_lm(**fields) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(tiny_transformer(**{"pre_norm": True, **fields}))


def batches(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        tokens = torch.randint(4, 20, (3, 9), generator=g)
        out.append({"input": tokens, "target": tokens.roll(-1, 1), "loss_mask": torch.ones_like(tokens, dtype=bool)})
    return out


def block_outputs(task, batch) -> dict[str, torch.Tensor]:
    """Every block's output on ``batch``, recorded by hooks of the test's own."""
    seen = {}
    handles = [
        block.module.register_forward_hook(lambda m, a, out, name=block.name: seen.__setitem__(name, out.clone()))
        for block in task.model.blocks()
    ]
    with torch.no_grad():
        task.eval().model(batch["input"])
    for h in handles:
        h.remove()
    return seen


def plant(module, sample: int, position: int, dim: int, value: float, calls=None):
    """A forward hook (registered first, so the analysis reads its result) that sets one output entry, in
    the calls numbered ``calls`` (from 0; None: in every call)."""
    count = [-1]

    def hook(m, args, out):
        count[0] += 1
        if calls is not None and count[0] not in calls:
            return None
        out = out.clone()
        out[sample, position, dim] = value
        return out

    return module.register_forward_hook(hook)


def lower_median(x: np.ndarray) -> float:
    flat = np.sort(x.ravel())
    return float(flat[(flat.size - 1) // 2])


@pytest.mark.parametrize("fields", [{}, LLAMA], ids=["fairseq-pre-norm", "llama-style"])
def test_a_planted_activation_is_found_where_it_was_put_with_its_ratio(fields):
    task, data = tiny_lm(**fields), batches()
    # in the test's own pass over the second batch (call 0), then in the analysis' (call 2, after the first batch)
    handle = plant(task.model.decoder.layers[1], sample=2, position=5, dim=7, value=-5000.0, calls={0, 2})
    outputs = block_outputs(task, data[1])  # sample 2 of the second batch is sample 5 overall
    result = massive_activations(task, data, MassiveSettings(top_k=3))
    handle.remove()
    entry = result["blocks"]["decoder.layers.1"]
    top = entry["top"][0]
    median = lower_median(outputs["decoder.layers.1"][2].abs().double().numpy())
    assert (top["sample"], top["position"], top["dim"], top["value"]) == (5, 5, 7, -5000.0)
    assert top["token"] == int(data[1]["input"][2, 5]) and top["magnitude"] == 5000.0
    assert top["ratio"] == pytest.approx(5000.0 / median, rel=1e-6)
    assert entry["massive"] == 1  # 5000 is above 100 and above 1000 x the median (about 1)
    # the planted entry is the only one: the next largest entry of that block and every other block's are small
    assert entry["top"][1]["magnitude"] < 100 and result["blocks"]["decoder.layers.0"]["massive"] == 0
    assert result["blocks"]["decoder.layers.0"]["top"][0]["magnitude"] < 100


def test_block_means_equal_a_float64_recomputation_over_samples():
    task, data = tiny_lm(), batches(seed=1)
    result = massive_activations(task, data, MassiveSettings(top_k=2, min_magnitude=1.0, min_ratio=1.5))
    assert task.training  # the mode is put back
    for name in ("decoder.layers.0", "decoder.layers.1"):
        mags = np.concatenate([block_outputs(task, b)[name].abs().double().numpy() for b in data])  # (6, T, d)
        medians = np.array([lower_median(m) for m in mags])
        tops = np.sort(mags.reshape(6, -1), axis=1)[:, ::-1][:, :2]
        entry = result["blocks"][name]
        assert entry["samples"] == 6
        assert entry["median"] == pytest.approx(medians.mean(), rel=1e-6)
        assert entry["top_mean"] == pytest.approx(tops.mean(0).tolist(), rel=1e-6)
        assert entry["ratio"] == pytest.approx((tops[:, 0] / medians).mean(), rel=1e-6)
        assert entry["massive"] == int(((mags > 1.0) & (mags > 1.5 * medians[:, None, None])).sum())
        assert [e["magnitude"] for e in entry["top"]] == pytest.approx(np.sort(mags.ravel())[::-1][:2].tolist())
    rows = dict(((b, m), v) for b, m, v in massive_rows(result))
    assert rows[("decoder.layers.1", "top2")] == result["blocks"]["decoder.layers.1"]["top_mean"][1]


def test_padding_is_never_reported_nor_counted_in_the_median():
    task, data = tiny_lm(), batches()
    data[0]["input"][0, 6:] = PAD  # sample 0 has 6 real positions
    handle = plant(task.model.decoder.layers[0], sample=0, position=7, dim=3, value=9000.0)  # on padding
    outputs = block_outputs(task, data[0])
    result = massive_activations(task, data[:1], MassiveSettings(top_k=1))
    handle.remove()
    entry = result["blocks"]["decoder.layers.0"]
    assert entry["massive"] == 0 and entry["top"][0]["magnitude"] < 9000.0
    medians = [lower_median(outputs["decoder.layers.0"][0, :6].abs().double().numpy())]
    medians += [lower_median(outputs["decoder.layers.0"][b].abs().double().numpy()) for b in (1, 2)]
    assert entry["median"] == pytest.approx(np.mean(medians), rel=1e-6)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        MassiveSettings(top_k=0)
