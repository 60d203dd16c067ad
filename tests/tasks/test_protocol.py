"""A task is a protocol: a task, its network and its DataModule defined here alone (nothing registered
anywhere) train with ``mmlight fit``, are recorded by the ``AttentionStats`` callback and analysed by
``mmlight analyze --robustness``, with values checked against computations made here.

The network names its attention layers ``early`` and ``late`` and its stack ``tokens``: names that
no analysis code could parse a layer or a kind out of, so every such fact must come from the records."""

import csv
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmlight.cli import main
from mmlight.nn import attention, record_attention
from mmlight.nn.sites import AttentionSite, Block, reweighting_modules
from mmlight.reweighting import ReweightingSpec
from mmlight.tasks.compiling import CompiledCalls, CompileOption
from mmlight.tasks.protocol import AnalysedTask, ExampleInputs, TaskMetric, TrainedTask, check_analysed_task
from tests.helpers.cli import analyze

PAD, VOCAB, LENGTH, CLASSES = 0, 8, 6, 3


class Look(nn.Module):
    """One causal attention layer with a residual connection."""

    def __init__(self, dim: int, heads: int, spec: ReweightingSpec):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.reweight = spec.build("reference")

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (B, nh, T, hs)
        y = attention(q, k, v, self.reweight, mask=keep[:, None, None, :], is_causal=True)
        return x + y.transpose(1, 2).reshape(B, T, C)


class ToyNet(nn.Module):
    """Embeddings, two causal looks, a mean over the real tokens, a linear head."""

    def __init__(self, dim: int, spec: ReweightingSpec):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.position = nn.Parameter(torch.randn(LENGTH, dim) * 0.1)
        self.looks = nn.ModuleDict({"early": Look(dim, 2, spec), "late": Look(dim, 2, spec)})
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != PAD  # (B, T)
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for look in self.looks.values():
            x = look(x, keep)
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1)
        return self.head(pooled)  # (B, CLASSES)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens), labels)

    def attention_sites(self) -> dict[str, AttentionSite]:
        return {
            name: AttentionSite(name, "decoder_self", "tokens", i, look.reweight)
            for i, (name, look) in enumerate(self.looks.items())
        }

    def reweighting_sites(self) -> dict:
        return reweighting_modules(self.attention_sites(), None)

    def blocks(self) -> list[Block]:
        return [Block(name, "tokens", i, look) for i, (name, look) in enumerate(self.looks.items())]


class ToyTask(L.LightningModule):
    """Classifies a padded token sequence; logs ``{stage}/acc`` over the whole split.

    Args:
        dim: the width of the network.
        lr: Adam's learning rate.
        attention: the reweighting of both looks.
        compile: the network's training loss and evaluation forward under ``torch.compile`` (``true``, or
            its keyword arguments).
    """

    task_metric = TaskMetric("acc", higher_is_better=True)
    interventions = ("sink_masking", "kv_eviction")
    counts_tokens = True

    def __init__(
        self,
        dim: int = 8,
        lr: float = 0.01,
        attention: ReweightingSpec = ReweightingSpec(),
        compile: CompileOption = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = ToyNet(dim, attention)
        self.compiled = CompiledCalls(compile, self.model)
        self.correct = {"val": [0, 0], "test": [0, 0]}

    def training_step(self, batch, batch_idx):
        loss = self.compiled(self.model.loss, batch["tokens"], batch["label"])
        self.log("train/loss", loss)
        return loss

    # what the throughput logs read (TrainedTask)
    def batch_counts(self, batch) -> tuple[int, int]:
        return batch["tokens"].shape[0], int((batch["tokens"] != PAD).sum())

    def training_loss(self, batch, network: nn.Module) -> torch.Tensor:
        return network.loss(batch["tokens"], batch["label"])

    def _eval_step(self, stage, batch):
        hits = self.compiled(self.model.forward, batch["tokens"]).argmax(-1) == batch["label"]
        self.correct[stage][0] += int(hits.sum())
        self.correct[stage][1] += len(hits)

    def _eval_end(self, stage):
        hits, total = self.correct[stage]
        self.correct[stage] = [0, 0]
        self.log(f"{stage}/acc", hits / total)

    def validation_step(self, batch, batch_idx):
        self._eval_step("val", batch)

    def on_validation_epoch_end(self):
        self._eval_end("val")

    def test_step(self, batch, batch_idx):
        self._eval_step("test", batch)

    def on_test_epoch_end(self):
        self._eval_end("test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    # the protocol
    def teacher_forced(self, batch) -> None:
        self.model(batch["tokens"])

    def query_keep(self, batch) -> dict:
        return {"tokens": batch["tokens"] != PAD}

    def example_inputs(self, batch) -> ExampleInputs:
        return ExampleInputs(tokens={"tokens": batch["tokens"]})

    def metric_evaluation(self, split, scratch):
        return nullcontext()


def toy_samples(n: int, seed: int) -> list[dict]:
    """Sequences of 2..LENGTH tokens (then padding); the label is the first token modulo CLASSES."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        tokens = torch.randint(1, VOCAB, (LENGTH,), generator=gen)
        tokens[int(torch.randint(2, LENGTH + 1, (), generator=gen)) :] = PAD
        samples.append({"tokens": tokens, "label": tokens[0] % CLASSES})
    return samples


class ToyData(L.LightningDataModule):
    """In-memory splits of :func:`toy_samples`.

    Args:
        batch_size: samples per batch.
    """

    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size
        self.splits = {"train": toy_samples(64, 1), "val": toy_samples(24, 2), "test": toy_samples(16, 3)}

    def _loader(self, split, shuffle=False):
        return torch.utils.data.DataLoader(self.splits[split], batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader("train", shuffle=True)

    def val_dataloader(self):
        return self._loader("val")

    def test_dataloader(self):
        return self._loader("test")


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  log_every_n_steps: 1
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args:
      save_dir: {runs}
      name: toy
best_checkpoint:
  monitor: val/acc
  mode: max
model:
  class_path: {module}.ToyTask
data:
  class_path: {module}.ToyData
"""


def hand_entropy(weights: torch.Tensor, keep: torch.Tensor) -> float:
    """Mean row entropy over every head's rows of real queries, by a loop over the rows."""
    B, H, T, _ = weights.shape
    values = []
    for b in range(B):
        for h in range(H):
            for q in range(T):
                if keep[b, q]:
                    p = weights[b, h, q].double()
                    values.append(float(-(p[p > 0] * p[p > 0].log()).sum()))
    return sum(values) / len(values)


def test_the_toy_task_satisfies_the_protocol_and_a_bare_module_is_named_clearly():
    task = ToyTask()
    check_analysed_task(task)
    assert isinstance(task, AnalysedTask) and isinstance(task, TrainedTask)
    with pytest.raises(TypeError) as refused:
        check_analysed_task(L.LightningModule())
    assert str(refused.value) == (
        "LightningModule lacks what attention analysis needs: task_metric, interventions, teacher_forced, "
        "query_keep, example_inputs, metric_evaluation, attention_sites() (LightningModule names no attention "
        "sites (no attention_sites() on it or its .model)) (see mmlight.tasks.protocol.AnalysedTask)"
    )


class SitesOnly(nn.Module):
    """A network that names its attention sites but not its blocks."""

    def attention_sites(self) -> dict:
        return {}


def test_a_network_without_blocks_is_named_with_what_the_task_lacks():
    task = L.LightningModule()
    task.model = SitesOnly()
    with pytest.raises(TypeError) as refused:
        check_analysed_task(task)
    assert str(refused.value) == (
        "LightningModule lacks what attention analysis needs: task_metric, interventions, teacher_forced, "
        "query_keep, example_inputs, metric_evaluation, blocks() on SitesOnly "
        "(see mmlight.tasks.protocol.AnalysedTask)"
    )


@pytest.mark.slow
def test_fit_attention_stats_and_analyze_with_robustness_on_a_task_defined_here(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(sys, "argv", ["mmlight"])
    config = tmp_path / "toy.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs", module=__name__))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(
            [
                "fit",
                "--config",
                str(config),
                "--trainer.callbacks+=mmlight.callbacks.AttentionStats",
                "--trainer.callbacks.every_n_epochs",
                "1",
                "--trainer.callbacks.num_samples",
                "10",
            ]
        )
    mmlight_warnings = [str(w.message) for w in caught if "mmlight" in w.filename or "Throughput" in str(w.message)]
    assert not [m for m in mmlight_warnings if "Throughput" in m], mmlight_warnings  # the template has its members
    ckpt = next((tmp_path / "runs").rglob("last.ckpt"))
    task = ToyTask.load_from_checkpoint(ckpt, map_location="cpu").eval()
    val = ToyData().splits["val"]
    tokens = torch.stack([s["tokens"] for s in val])  # (24, T)
    labels = torch.stack([s["label"] for s in val])

    # the callback's last recording (after the last epoch: the checkpoint's weights), on the first 10 samples
    event_file = next((tmp_path / "runs").rglob("events.out.tfevents*"))
    events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
    events.Reload()
    with torch.no_grad(), record_attention(task) as recorder:
        task.model(tokens[:10])
    for name in ("early", "late"):
        logged = events.Scalars(f"attention/{name}/entropy")
        assert len(logged) == 2  # one recording per validation epoch
        want = hand_entropy(recorder[name][0].weights, tokens[:10] != PAD)
        assert logged[-1].value == pytest.approx(want, rel=1e-5)
    assert len(events.Scalars("attention/late/token_similarity")) == 2
    assert events.Scalars("train/flops_per_sample")[0].value > 0  # the throughput logs run on the template

    out = tmp_path / "analysis"
    options = ("--num_samples", "16", "--robustness", "--kv_skip_layers", "1", "--kv_methods", "l2", "streaming")
    analyze(config, [ckpt], out, *options)
    with open(out / "robustness.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["intervention"], float(r["level"])) for r in rows] == (
        [("none", 0.0)]
        + [("sink_masking", k) for k in (1, 5, 10)]
        + [(f"kv_{m}", r) for m in ("l2", "streaming") for r in (1.0, 0.9, 0.7, 0.5, 0.3, 0.1)]
    )
    value = {(r["intervention"], float(r["level"])): float(r["value"]) for r in rows}
    assert {r["metric"] for r in rows} == {"acc"}
    with torch.no_grad():
        accuracy = (task.model(tokens).argmax(-1) == labels).double().mean().item()  # the whole val split
    assert value[("none", 0.0)] == pytest.approx(accuracy)
    # keeping every past key changes nothing; masking 10 sinks masks all 6 keys, so each look adds nothing
    assert value[("kv_l2", 1.0)] == value[("kv_streaming", 1.0)] == value[("none", 0.0)]
    with torch.no_grad():
        keep = tokens != PAD
        x = task.model.embed(tokens) + task.model.position  # (24, T, d): what the residuals carry alone
        bare = task.model.head((x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True))
    assert value[("sink_masking", 10.0)] == pytest.approx((bare.argmax(-1) == labels).double().mean().item())
    with torch.no_grad(), record_attention(task) as recorder:
        task.model(tokens[:16])
    with open(out / "stats.csv") as f:
        stats = {(r["layer"], r["head"], r["metric"]): r["value"] for r in csv.DictReader(f)}
    for name in ("early", "late"):
        want = hand_entropy(recorder[name][0].weights, tokens[:16] != PAD)
        assert float(stats[(name, "", "entropy")]) == pytest.approx(want, rel=1e-5)
    # the token similarity at the output of the first look: mean cosine over pairs of real tokens, per sample
    outputs = []
    handle = task.model.looks["early"].register_forward_hook(lambda module, args, y: outputs.append(y))
    with torch.no_grad():
        task.model(tokens[:16])
    handle.remove()
    sims = []
    for b, x in enumerate(outputs[0]):
        real = F.normalize(x[tokens[b] != PAD].double(), dim=-1)  # (n, d)
        n = real.shape[0]
        sims.append(float((real @ real.T).sum() - n) / (n * (n - 1)))
    assert float(stats[("early", "", "token_similarity")]) == pytest.approx(sum(sims) / len(sims), rel=1e-5)
    label = Path(ckpt).parent.parent.parent.name  # runs/toy/version_0/checkpoints/last.ckpt -> toy
    for name in (
        "stats.json",
        "summary.md",
        "robustness.png",
        "fig4_token_similarity.png",
        f"attention_heatmap_decoder_self_{label}.png",
    ):
        assert (out / name).stat().st_size > 0, name


def test_the_language_model_names_its_decoder_tokens_and_saves_no_vocabulary_it_lacks():
    """The text figures label the decoder's axes with the batch's input ids; a model not yet given its data
    writes no vocabulary into its checkpoints (and one given it writes its tokens)."""
    from mmlight.data.vocab import Vocab
    from mmlight.tasks import LanguageModel
    from tests.helpers.models import tiny_transformer

    task = LanguageModel(tiny_transformer(n_layers=1))
    batch = {"input": torch.tensor([[5, 6, 7]]), "target": torch.tensor([[6, 7, 2]])}
    inputs = task.example_inputs(batch)
    assert list(inputs.tokens) == ["decoder"] and inputs.tokens["decoder"] is batch["input"]
    assert inputs.image is None and inputs.patch_grid is None
    assert task.data_state() == {}
    task.vocab = Vocab(["<s>", "<pad>", "</s>", "<unk>", "a"])
    assert task.data_state()["vocab"]["tokens"] == ["<s>", "<pad>", "</s>", "<unk>", "a"]


def smoothed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, eps: float) -> float:
    """Mean over the kept positions of ``(1 - eps) * nll + eps * mean over classes of -log p``, in float64."""
    logp = logits.detach().double().log_softmax(-1)[keep]  # (N, V)
    nll = -logp.gather(-1, targets[keep][:, None]).squeeze(-1)
    return float(((1 - eps) * nll - eps * logp.mean(-1)).mean())


@pytest.mark.parametrize("kind", ["lm", "translator"])
def test_the_sequence_tasks_count_and_score_a_training_batch_as_by_hand(kind):
    """``batch_counts`` and ``training_loss``, what the throughput callback reads: the samples and the
    scored tokens of a batch with masked targets, and the label-smoothed mean loss by the formula."""
    from mmlight.models.transformer import TransformerConfig
    from mmlight.tasks import LanguageModel, Translator

    torch.manual_seed(0)
    fields = dict(vocab_size=11, d_model=16, n_heads=2, ffn_dim=24, n_layers=1, dropout=0.0)
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)  # 12 scored
    tokens, targets = torch.randint(4, 11, (3, 5)), torch.randint(4, 11, (3, 5))
    if kind == "lm":
        task = LanguageModel(TransformerConfig(**fields), label_smoothing=0.2)
        batch = {"input": tokens, "target": targets, "loss_mask": keep}
        logits = task.model.logits(task.model(tokens))
    else:
        task = Translator(TransformerConfig(**fields, n_encoder_layers=1), label_smoothing=0.2)
        src, src_mask = torch.randint(4, 11, (3, 4)), torch.ones(3, 4, dtype=torch.bool)
        batch = {"src": src, "tgt_in": tokens, "tgt_out": targets, "src_mask": src_mask, "tgt_mask": keep}
        logits = task.model.logits(task.model(src, tokens, src_mask))
    assert task.batch_counts(batch) == (3, 12)
    want = smoothed_cross_entropy(logits, targets, keep, 0.2)
    assert task.training_loss(batch, task.model).item() == pytest.approx(want, rel=1e-5)
