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


def scale_output(module, factor: float):
    """A forward hook (registered first) that multiplies the module's output by ``factor``."""
    return module.register_forward_hook(lambda m, args, out: out * factor)


def test_small_activations_padding_still_sorts_last_and_ratios_are_kept():
    """Block outputs scaled by 1e-3 (every magnitude and median far below 1), sample 0 padded after 6
    positions: the largest entries are real ones, with their ratios to medians of about 1e-3, and the
    per-block means equal a float64 recomputation over the real positions."""
    task, data = tiny_lm(), batches(seed=2)[:1]
    data[0]["input"][0, 6:] = PAD
    handle = scale_output(task.model.decoder.layers[1], 1e-3)
    outputs = block_outputs(task, data[0])["decoder.layers.1"].double()
    result = massive_activations(task, data, MassiveSettings(top_k=3, min_magnitude=0.0, min_ratio=2.0))
    handle.remove()
    entry = result["blocks"]["decoder.layers.1"]
    mags = [outputs[0, :6].abs().numpy(), outputs[1].abs().numpy(), outputs[2].abs().numpy()]
    medians = np.array([lower_median(m) for m in mags])
    assert medians.max() < 0.01
    tops = np.array([np.sort(m.ravel())[::-1][:3] for m in mags])
    assert entry["median"] == pytest.approx(medians.mean(), rel=1e-6)
    assert entry["top_mean"] == pytest.approx(tops.mean(0).tolist(), rel=1e-6)
    assert entry["ratio"] == pytest.approx((tops[:, 0] / medians).mean(), rel=1e-6)
    assert entry["massive"] == sum(int((m > 2.0 * med).sum()) for m, med in zip(mags, medians))
    want = sorted(((float(v), s) for s, m in enumerate(mags) for v in m.ravel()), reverse=True)[:3]
    assert [e["magnitude"] for e in entry["top"]] == pytest.approx([v for v, _ in want], rel=1e-6)
    for e in entry["top"]:
        assert e["position"] < 6 or e["sample"] != 0
        assert e["ratio"] == pytest.approx(e["magnitude"] / medians[e["sample"]], rel=1e-6)


def test_a_sample_with_fewer_real_entries_than_top_k_lists_only_those():
    """One sample with one real position (16 entries) and top_k 20: the top lists its 16 entries, in
    order of magnitude, all at position 0 (none of the padding)."""
    task = tiny_lm()
    tokens = torch.full((1, 5), PAD)
    tokens[0, 0] = 7
    batch = {"input": tokens, "target": tokens.roll(-1, 1), "loss_mask": torch.ones_like(tokens, dtype=bool)}
    outputs = block_outputs(task, batch)["decoder.layers.0"].double()
    entry = massive_activations(task, [batch], MassiveSettings(top_k=20))["blocks"]["decoder.layers.0"]
    want = np.sort(outputs[0, 0].abs().numpy())[::-1]
    assert [e["position"] for e in entry["top"]] == [0] * 16
    assert [e["magnitude"] for e in entry["top"]] == pytest.approx(want.tolist(), rel=1e-6)


def test_a_sample_of_median_zero_has_no_ratio():
    """Sample 1's block output zeroed but for one entry of 7: its median is 0, so its top entry has no
    ratio and the block's mean ratio is over the other two samples (against a float64 recomputation)."""
    task, data = tiny_lm(), batches(seed=3)[:1]

    def zero_sample_1(m, args, out):
        out = torch.zeros_like(out).where(torch.arange(3)[:, None, None] == 1, out)
        out[1, 4, 2] = 7.0
        return out

    handle = task.model.decoder.layers[1].register_forward_hook(zero_sample_1)
    outputs = block_outputs(task, data[0])["decoder.layers.1"].double()
    entry = massive_activations(task, data, MassiveSettings(top_k=1))["blocks"]["decoder.layers.1"]
    handle.remove()
    mags = outputs.abs().numpy()
    medians = np.array([lower_median(m) for m in mags])
    assert medians[1] == 0.0 and mags.max() == 7.0
    assert entry["ratio"] == pytest.approx(np.mean([mags[b].max() / medians[b] for b in (0, 2)]), rel=1e-6)
    assert entry["top"][0]["sample"] == 1 and entry["top"][0]["ratio"] is None
    assert entry["median"] == pytest.approx(medians.mean(), rel=1e-6)


def test_top_means_are_summed_in_float64():
    """A planted magnitude of 2^24 beside ordinary ones: the mean largest magnitude is exact to float64
    rounding (a float32 running sum would be off by about 1/3)."""
    task, data = tiny_lm(), batches(seed=4)[:1]
    handle = plant(task.model.decoder.layers[1], sample=0, position=2, dim=5, value=2.0**24)
    outputs = block_outputs(task, data[0])["decoder.layers.1"].double()
    entry = massive_activations(task, data, MassiveSettings(top_k=1))["blocks"]["decoder.layers.1"]
    handle.remove()
    want = outputs.abs().flatten(1).max(1).values.mean()
    assert entry["top_mean"][0] == pytest.approx(float(want), rel=1e-12, abs=0)


def test_zero_entries_are_listed_and_no_median_above_zero_gives_no_ratio():
    """Block outputs all zero but one entry of 7: the top 2 are 7 and a zero (a real entry, listed, with
    no ratio), and no sample has a median above zero, so the block has no mean ratio."""
    task, data = tiny_lm(), batches(seed=5)[:1]

    def zero_all_but_one(m, args, out):
        out = torch.zeros_like(out)
        out[1, 4, 2] = 7.0
        return out

    handle = task.model.decoder.layers[1].register_forward_hook(zero_all_but_one)
    entry = massive_activations(task, data, MassiveSettings(top_k=2))["blocks"]["decoder.layers.1"]
    handle.remove()
    assert [e["magnitude"] for e in entry["top"]] == [7.0, 0.0]
    assert [e["ratio"] for e in entry["top"]] == [None, None]
    assert (entry["median"], entry["ratio"], entry["massive"]) == (0.0, None, 0)
    assert entry["top_mean"] == pytest.approx([7 / 3, 0.0])  # a zero is a real entry: every sample has a 2nd


@pytest.mark.parametrize("planted, settings", [((256.0, 257.0), (256.0, 1024.0)), ((128.0, 129.0), (64.0, 1024.0))])
def test_an_entry_is_massive_strictly_above_both_thresholds(planted, settings):
    """Outputs of magnitude 0.125 (the median of every sample) with two planted entries: one exactly at a
    threshold (the magnitude threshold, or the ratio threshold 1024 x 0.125 = 128) is not massive, one
    above both is. Powers of two keep the products exact in float32."""
    task, data = tiny_lm(), batches(seed=5)[:1]

    def flat_with_two(m, args, out):
        out = torch.full_like(out, -0.125)
        out[0, 2, 3], out[0, 5, 1] = planted
        return out

    handle = task.model.decoder.layers[1].register_forward_hook(flat_with_two)
    options = MassiveSettings(min_magnitude=settings[0], min_ratio=settings[1])
    entry = massive_activations(task, data, options)["blocks"]["decoder.layers.1"]
    handle.remove()
    assert (entry["median"], entry["massive"]) == (0.125, 1)


def test_without_a_keep_mask_every_position_counts_and_no_token_is_named():
    """The recorder used directly, told no real positions nor tokens (``next_batch({}, {}, 10)``): every
    position counts in the median and the top, the samples numbered from 10, with no token."""
    from mmlight.analysis.massive import MassiveActivations

    task, data = tiny_lm(), batches(seed=6)
    outputs = block_outputs(task, data[0])["decoder.layers.0"].double()
    recorder = MassiveActivations(task.model, MassiveSettings(top_k=2))
    recorder.next_batch({}, {}, 10)
    with torch.no_grad():
        task.model(data[0]["input"])
    recorder.remove()
    entry = recorder.sums["decoder.layers.0"].summary()
    mags = outputs.abs().numpy()
    assert entry["samples"] == 3
    assert entry["median"] == pytest.approx(np.mean([lower_median(m) for m in mags]), rel=1e-6)
    flat = mags.reshape(3, -1)
    best = np.unravel_index(np.argmax(flat), flat.shape)
    top = entry["top"][0]
    assert (top["sample"], top["token"]) == (10 + int(best[0]), None)
    assert (top["position"], top["dim"]) == divmod(int(best[1]), mags.shape[2])


def test_massive_rows_list_every_metric_of_every_block_in_order():
    """The rows of a hand-made result: per block the median, top1 .. topk, the ratio and the count."""
    result = {
        "blocks": {
            "encoder.layers.0": {"median": 0.5, "top_mean": [9.0, 4.0], "ratio": 18.0, "massive": 0, "top": []},
            "decoder.layers.0": {"median": None, "top_mean": [], "ratio": None, "massive": 2, "top": []},
        }
    }
    assert massive_rows(result) == [
        ("encoder.layers.0", "median", 0.5),
        ("encoder.layers.0", "top1", 9.0),
        ("encoder.layers.0", "top2", 4.0),
        ("encoder.layers.0", "ratio", 18.0),
        ("encoder.layers.0", "massive", 0),
        ("decoder.layers.0", "median", None),
        ("decoder.layers.0", "ratio", None),
        ("decoder.layers.0", "massive", 2),
    ]


def test_the_i_th_largest_is_averaged_over_the_samples_that_have_an_i_th_real_entry():
    """Sample 0 has one real position (16 entries), sample 1 five (80); top_k 20: the first 16 means are
    over both samples, the next 4 over sample 1 alone (no padding stand-in counted), against float64."""
    task = tiny_lm()
    tokens = torch.tensor([[7, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9]])
    batch = {"input": tokens, "target": tokens.roll(-1, 1), "loss_mask": tokens != PAD}
    outputs = block_outputs(task, batch)["decoder.layers.0"].double().abs()
    short = np.sort(outputs[0, 0].numpy())[::-1]  # (16,)
    full = np.sort(outputs[1].reshape(-1).numpy())[::-1][:20]
    entry = massive_activations(task, [batch], MassiveSettings(top_k=20))["blocks"]["decoder.layers.0"]
    want = [(short[i] + full[i]) / 2 for i in range(16)] + full[16:].tolist()
    assert entry["top_mean"] == pytest.approx(want, rel=1e-6)
    alone = massive_activations(task, [{k: v[:1] for k, v in batch.items()}], MassiveSettings(top_k=20))
    assert alone["blocks"]["decoder.layers.0"]["top_mean"][16:] == [None] * 4


def test_each_block_names_its_stack_and_layer_and_a_pass_over_no_batch_has_no_figures():
    """The result names each block's stack and layer (what the figures group by); over an empty list of
    batches every block reports 0 samples and no median, top means, ratio or entry."""
    task = tiny_lm()
    result = massive_activations(task, batches(seed=2))
    assert [(name, e["stack"], e["layer"]) for name, e in result["blocks"].items()] == [
        ("decoder.layers.0", "decoder", 0),
        ("decoder.layers.1", "decoder", 1),
    ]
    empty = massive_activations(task, [])
    assert list(empty["blocks"]) == list(result["blocks"])
    for name, entry in empty["blocks"].items():
        assert {k: v for k, v in entry.items() if k not in ("stack", "layer")} == {
            "samples": 0,
            "median": None,
            "top_mean": [],
            "ratio": None,
            "massive": 0,
            "top": [],
        }, name
