"""What the language-model and translation tasks share: the fairseq optimiser recipe (Adam with
decoupled weight decay, inverse-sqrt or cosine schedule), the check that model and data agree on the
vocabulary, the vocabulary kept in checkpoints, and perplexity from summed NLL and token counts synced
across ranks."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import lightning as L
import torch
from torch import nn
from torchmetrics import SumMetric

from mmlight.data.vocab import Vocab
from mmlight.models.transformer import TransformerConfig
from mmlight.tasks.inference import CarriesData
from mmlight.tasks.optim import param_groups, warmup_cosine, warmup_inverse_sqrt
from mmlight.tasks.stages import EvalStages

log = logging.getLogger(__name__)

Schedule = Literal["inverse_sqrt", "cosine"]


@dataclass(frozen=True)
class AdamRecipe:
    """The optimiser recipe of the sequence tasks, fairseq's: Adam with decoupled weight decay and an
    inverse-sqrt or cosine schedule. The defaults are fairseq's ``transformer_lm`` on WikiText-103.
    Configs set its fields as flat task options (``model.init_args.lr``), as before it was a dataclass.

    Args:
        lr: peak learning rate (fairseq recipe: 5e-4).
        betas: Adam betas (fairseq recipes: 0.9, 0.98).
        eps: Adam epsilon.
        weight_decay: decoupled, as fairseq's ``adam``; not applied to 1-D parameters or to the
            reweighting parameters.
        schedule: ``inverse_sqrt`` (fairseq's: linear warmup, then ``peak * sqrt(warmup / step)``) or
            ``cosine`` (linear warmup, then cosine decay to ``min_lr`` at the last step).
        warmup_steps: optimiser steps of linear warmup (fairseq recipe: 4000).
        min_lr: the cosine schedule's floor.
        label_smoothing: of the training loss (evaluation reports the plain NLL).
    """

    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: Schedule = "inverse_sqrt"
    warmup_steps: int = 4000
    min_lr: float = 1e-5
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.schedule not in ("inverse_sqrt", "cosine"):
            raise ValueError(f"schedule must be 'inverse_sqrt' or 'cosine', got {self.schedule!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")


class SequenceTask(CarriesData, EvalStages, L.LightningModule):
    """Base of :class:`~mmlight.tasks.LanguageModel` and :class:`~mmlight.tasks.Translator`.

    Subclasses build ``self.model`` (a transformer whose ``config`` is a
    :class:`~mmlight.models.TransformerConfig`) and feed :meth:`update_nll` in their evaluation steps;
    :meth:`configure_optimizers` follows their :class:`AdamRecipe`. Each takes the recipe's fields as
    keyword arguments (``**recipe``), so a config sets them flat, and saves all of them, defaults
    included, as hyperparameters.

    The data's :class:`~mmlight.data.vocab.Vocab` is taken in ``setup`` and kept in checkpoints, so
    that a loaded checkpoint encodes and decodes text by itself (:attr:`vocab`).

    Args:
        recipe: the subclass's optimiser recipe, checked when it was built.
    """

    model: nn.Module
    #: batches hold tokens: the throughput logs report tokens/s
    counts_tokens = True
    #: the data's vocabulary: from the DataModule in ``setup``, or from the checkpoint
    vocab: Vocab | None = None

    def __init__(self, recipe: AdamRecipe):
        super().__init__()
        self.recipe = recipe
        # Summed NLL and scored-token counts per stage; compute() all-reduces them once per epoch.
        self.nll_sums = nn.ModuleDict({stage: SumMetric() for stage in ("val", "test")})
        self.token_counts = nn.ModuleDict({stage: SumMetric() for stage in ("val", "test")})

    def training_loss(self, batch, network: nn.Module) -> torch.Tensor:
        """``network``'s training loss on ``batch`` (the subclass's ``summed_training_loss`` by
        ``network.loss``), uncompiled: what the throughput callback counts FLOPs of."""
        return self.mean_training_loss(batch, network.loss)[0]

    def mean_training_loss(self, batch, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean of :meth:`summed_training_loss` by ``loss_fn`` over the scored targets (0 when there
        are none), and their count."""
        loss_sum, count = self.summed_training_loss(batch, loss_fn)
        return loss_sum / count.clamp_min(1), count

    @property
    def config(self) -> TransformerConfig:
        return self.model.config

    # ------------------------------------------------------------------ checks
    def setup(self, stage: str) -> None:
        """Stop before any step when the data's vocabulary or padding id is not the model's."""
        datamodule = self.trainer.datamodule
        if datamodule is None:
            return
        vocab_size, pad_id = getattr(datamodule, "vocab_size", None), getattr(datamodule, "pad_id", None)
        if vocab_size is not None and vocab_size != self.config.vocab_size:
            raise ValueError(
                f"the data's vocabulary has {vocab_size} tokens but model.vocab_size is "
                f"{self.config.vocab_size}: set model.model.vocab_size: {vocab_size}"
            )
        if pad_id is not None and pad_id != self.config.pad_id:
            raise ValueError(f"the data pads with id {pad_id} but model.pad_id is {self.config.pad_id}")
        if isinstance(getattr(datamodule, "vocab", None), Vocab):
            self.use_data(datamodule)

    # ------------------------------------------------------------------ the vocabulary
    def use_data(self, datamodule) -> None:
        """Take ``datamodule.vocab`` (a :class:`~mmlight.data.vocab.Vocab`), checked against the model."""
        vocab = getattr(datamodule, "vocab", None)
        if not isinstance(vocab, Vocab):
            raise TypeError(f"{type(datamodule).__name__} has no typed vocabulary (.vocab)")
        if len(vocab) != self.config.vocab_size:
            raise ValueError(
                f"the data's vocabulary has {len(vocab)} tokens but model.vocab_size is {self.config.vocab_size}"
            )
        self.vocab = vocab

    def data_state(self) -> dict:
        return {} if self.vocab is None else {"vocab": self.vocab.to_dict()}

    def load_data_state(self, state: dict) -> None:
        saved = Vocab.from_dict(state["vocab"])
        if self.vocab is not None and (self.vocab.tokens, self.vocab.special_ids) != (saved.tokens, saved.special_ids):
            differ = next((i for i, (a, b) in enumerate(zip(saved.tokens, self.vocab.tokens)) if a != b), None)
            where = (
                f"id {differ} is {saved.tokens[differ]!r} there, {self.vocab.tokens[differ]!r} here"
                if differ is not None
                else f"{len(saved)} vs {len(self.vocab)} tokens"
            )
            raise ValueError(
                f"the checkpoint's vocabulary is not the data's ({where}): the model was trained on other data"
            )
        if self.vocab is None:
            self.vocab = saved

    def require_vocab(self) -> Vocab:
        """The vocabulary, or an error that says how to attach one (a checkpoint written without it)."""
        if self.vocab is None:
            raise self.missing("vocabulary", self.datamodule_name)
        return self.vocab

    # ------------------------------------------------------------------ perplexity
    def update_nll(self, stage: str, nll_sum: torch.Tensor, count: torch.Tensor) -> None:
        """Add one batch's summed NLL (nats) and number of scored tokens to ``stage``'s totals."""
        self.nll_sums[stage].update(nll_sum.float())
        self.token_counts[stage].update(count.float())

    def log_perplexity(self, stage: str) -> None:
        """Log ``{stage}/loss`` (mean NLL per token, nats) and ``{stage}/ppl`` = exp(loss) over the
        whole split, from the totals summed over every rank. Every rank must call it."""
        nll, count = self.nll_sums[stage].compute(), self.token_counts[stage].compute()
        self.nll_sums[stage].reset()
        self.token_counts[stage].reset()
        if count.item() == 0:
            log.warning("%s: no scored tokens on any rank, so no loss or perplexity is logged", stage)
            return
        loss = nll / count
        self.log(f"{stage}/loss", loss, sync_dist=False)  # already global
        self.log(f"{stage}/ppl", torch.exp(loss), prog_bar=True, sync_dist=False)
        self.log(f"{stage}/tokens", count, sync_dist=False)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        hp = self.recipe
        optimizer = torch.optim.AdamW(
            param_groups(self.model, hp.weight_decay), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps
        )
        if hp.schedule == "inverse_sqrt":
            scheduler = warmup_inverse_sqrt(optimizer, hp.warmup_steps)
        else:
            total = self.trainer.estimated_stepping_batches
            if not math.isfinite(total) or total <= 0:
                raise ValueError("the cosine schedule needs a finite run: set trainer.max_steps or max_epochs")
            total = int(total)
            scheduler = warmup_cosine(
                optimizer, min(hp.warmup_steps, total), total, min_lr_ratio=min(1.0, hp.min_lr / hp.lr)
            )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
