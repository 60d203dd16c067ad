"""Language modelling (fairseq ``transformer_lm`` on WikiText-103, the paper's Section 5.1.2) with a
swappable attention reweighting and an optional MultiMax output layer."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torchmetrics import SumMetric
from torch import nn

from mmlight.models.transformer import TransformerConfig, TransformerLM
from mmlight.tasks.protocol import ExampleInputs, TaskMetric
from mmlight.tasks.sequence import Schedule, SequenceTask


class LanguageModel(SequenceTask):
    """Trains a :class:`~mmlight.models.TransformerLM` on batches ``{input, target, loss_mask}``
    (:class:`~mmlight.data.WikiTextDataModule`, :class:`~mmlight.data.RecallDataModule`).

    Evaluation logs ``{stage}/loss`` (NLL per scored token, nats) and ``{stage}/ppl`` over the whole
    split from summed NLL and token counts synced across ranks. On WikiText every word and every
    end-of-line ``</s>`` is a scored token, so this is fairseq's per-word perplexity; the context each
    token is scored with is the DataModule's ``eval_block_size``/``eval_context``. No softmax over
    ``(B, T, V)`` is kept for the metric: the loss goes through the (fused) cross-entropy.

    Args:
        model: the architecture (e.g. the ``transformer_lm_wikitext103`` preset's fields).
        lr: peak learning rate (fairseq recipe: 5e-4).
        betas: Adam betas.
        eps: Adam epsilon.
        weight_decay: decoupled weight decay (fairseq recipe: 0.01).
        schedule: ``inverse_sqrt`` or ``cosine`` (see :class:`~mmlight.tasks.sequence.SequenceTask`).
        warmup_steps: linear warmup in optimiser steps (fairseq recipe: 4000).
        min_lr: floor of the cosine schedule.
        label_smoothing: label smoothing of the training loss (fairseq's LM uses none).
        accuracy: also report ``{stage}/acc``, the fraction of scored targets predicted exactly
            (argmax). It materialises the logits of the scored positions, so leave it off for a
            267k-word vocabulary; the associative-recall quick start turns it on.
    """

    task_metric = TaskMetric("ppl", higher_is_better=False)
    interventions = ("sink_masking", "kv_eviction")

    def __init__(
        self,
        model: TransformerConfig,
        lr: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        schedule: Schedule = "inverse_sqrt",
        warmup_steps: int = 4000,
        min_lr: float = 1e-5,
        label_smoothing: float = 0.0,
        accuracy: bool = False,
    ):
        super().__init__(schedule, label_smoothing)
        self.save_hyperparameters()
        self.model = TransformerLM(model)
        if accuracy:
            self.correct = nn.ModuleDict({stage: SumMetric() for stage in ("val", "test")})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token scores ``(B, T, V)`` of ``tokens`` ``(B, T)``."""
        return self.model.logits(self.model(tokens))

    def training_step(self, batch, batch_idx):
        loss_sum, count = self.model.loss(batch["input"], batch["target"], batch["loss_mask"],
                                          label_smoothing=self.hparams.label_smoothing)
        loss = loss_sum / count.clamp_min(1)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, stage: str, batch) -> None:
        hidden = self.model(batch["input"])  # (B, T, d)
        nll_sum, count = self.model.summed_loss(hidden, batch["target"], batch["loss_mask"])
        self.update_nll(stage, nll_sum, count)
        if self.hparams.accuracy:
            scored = batch["loss_mask"] & (batch["target"] != self.config.pad_id)  # (B, T)
            predicted = self.model.logits(hidden[scored]).argmax(dim=-1)  # (N,)
            self.correct[stage].update((predicted == batch["target"][scored]).sum().float())

    def _eval_epoch_end(self, stage: str) -> None:
        if self.hparams.accuracy:  # read before log_perplexity resets the token count
            correct, count = self.correct[stage].compute(), self.token_counts[stage].compute()
            self.correct[stage].reset()
            if count.item() > 0:
                self.log(f"{stage}/acc", correct / count, prog_bar=True, sync_dist=False)
        self.log_perplexity(stage)

    def predict_step(self, batch, batch_idx) -> dict[str, torch.Tensor]:
        """Scores text: for each sequence of the batch, the summed NLL (nats) of its scored targets and
        their count, ``{"nll": (B,), "tokens": (B,)}`` (e.g. per-window or per-document perplexity)."""
        hidden = self.model(batch["input"])  # (B, T, d)
        rows = [self.model.summed_loss(hidden[b:b + 1], batch["target"][b:b + 1], batch["loss_mask"][b:b + 1])
                for b in range(hidden.shape[0])]
        return {"nll": torch.stack([nll for nll, _ in rows]), "tokens": torch.stack([n for _, n in rows])}

    # ------------------------------------------------------------------ attention analysis
    def teacher_forced(self, batch) -> None:
        self.model(batch["input"])

    def query_keep(self, batch) -> dict[str, torch.Tensor | None]:
        return {"decoder": batch["input"] != self.config.pad_id}

    def example_inputs(self, batch) -> ExampleInputs:
        return ExampleInputs(tokens={"decoder": batch["input"]})

    def metric_evaluation(self, split: str, scratch):
        return nullcontext()  # validate and test both log ppl and write nothing
