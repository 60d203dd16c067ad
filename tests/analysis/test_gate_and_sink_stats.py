"""The analysis of the 2025 sink mechanisms: a learned sink's null mass, and a gated model's gate
statistics (mean gate and fraction below 0.1 per layer and head), against values computed here from
the model's own gate outputs and recorded weights."""

import pytest
import torch

from mmlight.analysis.stats import GATE_METRICS, Settings, collect_statistics, metric_rows, record_statistics
from mmlight.callbacks.attention_stats import finish_recording
from mmlight.commands.analyze import write_summary
from mmlight.models import TransformerConfig
from mmlight.nn.attention import record_attention
from mmlight.reweighting import ReweightingSpec
from mmlight.tasks import LanguageModel

PAD = 1
SITES = ("decoder.layers.0.self_attn", "decoder.layers.1.self_attn")


def lm_task(name="softmax", gate="none"):
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=20, d_model=16, n_heads=2, ffn_dim=32, n_layers=2, max_positions=32, pad_id=PAD,
        attention=ReweightingSpec(name), gate=gate,
    )  # fmt: skip
    return LanguageModel(model=config)


def padded_batch():
    tokens = torch.randint(2, 20, (3, 7), generator=torch.Generator().manual_seed(1))
    tokens[1, 4:] = PAD
    tokens[2, 2:] = PAD
    return {"input": tokens, "target": tokens}, tokens != PAD


def test_a_learned_sinks_null_mass_is_one_minus_the_recorded_mass_of_each_real_row():
    task = lm_task("sink")
    with torch.no_grad():
        for site in SITES:  # sinks away from 0, one high and one low, so the heads differ
            task.model.attention_sites()[site].module.sink_logit.copy_(torch.tensor([2.0, -1.0]))
    batch, real = padded_batch()
    stats = collect_statistics(task, [batch])
    with record_attention(task) as recorder:
        task.model.eval()
        task.model(batch["input"])
    for site in SITES:
        mass = recorder[site][0].weights.double().sum(-1)  # (B, nh, T)
        want = [(1 - mass[:, h][real]).mean().item() for h in range(2)]
        assert stats["sites"][site]["heads"]["null_mass"] == pytest.approx(want, rel=1e-9)
        assert want[0] > want[1] > 0  # the higher sink logit takes more


def gate_values(task, batch):
    """Each gated site's gate output ``(B, nh, T, width)`` in one eval forward pass, by hooks set here."""
    seen = {}
    sites = task.model.attention_sites()
    hooks = [sites[s].gate.register_forward_hook(lambda m, a, out, s=s: seen.__setitem__(s, out)) for s in SITES]
    task.model.eval()
    with torch.no_grad():
        task.model(batch["input"])
    for handle in hooks:
        handle.remove()
    return seen


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gate_statistics_per_head_over_real_queries(gate):
    task = lm_task("softmax", gate)
    with torch.no_grad():  # gates spread over (0, 1), many below 0.1
        for site in SITES:
            task.model.attention_sites()[site].gate.weight.normal_(std=2.0)
    batch, real = padded_batch()
    stats = collect_statistics(task, [batch], Settings(low_gate=0.1))
    for site, g in gate_values(task, batch).items():
        g = g.double()
        heads = stats["sites"][site]["heads"]
        rows = real[:, None, :].expand(g.shape[:3])  # (B, nh, T)
        assert heads["gate_mean"] == pytest.approx([g[:, h].mean(-1)[rows[:, h]].mean().item() for h in range(2)])
        below = [(g[:, h][rows[:, h]] < 0.1).double().mean().item() for h in range(2)]
        assert heads["gate_below_0.1"] == pytest.approx(below) and 0 < sum(below) < 2
        layer = stats["sites"][site]["metrics"]
        assert layer["gate_below_0.1"] == pytest.approx((g[rows] < 0.1).double().mean().item())
        assert layer["gate_mean"] == pytest.approx(g.mean(-1)[rows].mean().item())


def test_gate_rows_reach_the_callbacks_scalars_and_the_summary_and_only_for_gated_models(tmp_path):
    batch, _ = padded_batch()
    gated = finish_recording(record_statistics(lm_task("softmax", "elementwise"), [batch]), "epoch 0", None)
    for site in SITES:
        for metric in GATE_METRICS:
            assert 0 <= gated["scalars"][f"attention/{site}/{metric}"] <= 1
            assert (
                len([r for r in metric_rows(gated["stats"]) if r[0] == site and r[2] == metric]) == 3
            )  # 2 heads + layer
    plain = collect_statistics(lm_task(), [batch])
    assert not any(metric in GATE_METRICS for _, _, metric, _ in metric_rows(plain))
    meta = {"num_samples": 3, "split": "val", "settings": Settings().__dict__}
    write_summary(tmp_path, {"plain": plain, "gated": gated["stats"]}, meta, [], [])
    lines = (tmp_path / "summary.md").read_text().splitlines()
    header, _, plain_row, gated_row = lines[4:8]
    assert lines[2].endswith(
        "stats.csv has each layer). gate_mean and gate_below_0.1 (gate values below 0.1): over the gated layers."
    )
    assert header.split(" | ")[-2:] == ["gate_mean", "gate_below_0.1 |"]
    assert plain_row.split(" | ")[-2:] == ["nan", "nan |"] and "nan" not in gated_row.split(" | ")[-1]
