"""Image classification (DeiT recipe) with a swappable attention reweighting."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from contextlib import nullcontext

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from mmlight.data.images import ImageAugment, eval_images
from mmlight.data.vocab import ClassMap
from mmlight.models import ReweightedViT, ViTConfig
from mmlight.tasks.compiling import CompiledCalls, CompileOption
from mmlight.tasks.inference import CarriesData, device_of, evaluating
from mmlight.tasks.optim import param_groups, reweighting_parameter_ids, warmup_cosine
from mmlight.tasks.protocol import ExampleInputs, TaskMetric
from mmlight.tasks.stages import EvalStages


class ImageClassifier(CarriesData, EvalStages, L.LightningModule):
    """Trains a :class:`~mmlight.models.ReweightedViT`. The data's class names and evaluation
    transform are taken in ``setup`` and kept in checkpoints, so that :meth:`classify` works on a
    loaded checkpoint alone.

    Args:
        model: the architecture, including the attention reweighting.
        lr: peak learning rate, before batch scaling.
        lr_reference_batch: if set, the peak is ``lr * global_batch / lr_reference_batch`` (DeiT: 512).
        weight_decay: AdamW decoupled weight decay (not applied to 1-D, position-embedding or
            reweighting parameters).
        betas: AdamW betas.
        warmup_epochs: linear warmup length in epochs, converted to optimiser steps.
        min_lr: floor of the cosine schedule.
        label_smoothing: label smoothing of the cross-entropy (also inside mixup's soft targets).
        mixup_alpha: mixup Beta parameter; 0 disables mixup.
        cutmix_alpha: cutmix Beta parameter; 0 disables cutmix.
        mixup_switch_prob: probability of cutmix instead of mixup when both are on.
        ema_decay: if set, keep an exponential moving average of the weights and also report its
            validation accuracy as ``val/ema_top1``.
        head_lr_mult: learning rate of the classifier head, as a multiple of the peak.
        reweighting_lr_mult: learning rate of the reweighting parameters (MultiMax's ``ranges``/``ts``
            in every layer and on the logits), as a multiple of the peak; layer decay does not apply.
        layer_decay: layer-wise learning-rate decay (BEiT, MAE fine-tuning): a parameter at depth
            ``l`` of ``L`` (:meth:`~mmlight.models.ReweightedViT.layer_ids`) trains at
            ``layer_decay ** (L - l)`` x the peak. None: no decay.
        freeze_backbone_epochs: for this many first epochs only the head and the reweighting
            parameters train: the other gradients are discarded before each step, so AdamW neither
            moves them (no decay either) nor builds state for them.
        compile: compile the network's training and evaluation forward (and the EMA's) with
            ``torch.compile``: ``true``, or its keyword arguments (``{mode: max-autotune}``);
            see :mod:`mmlight.tasks.compiling`.
    """

    task_metric = TaskMetric("top1", higher_is_better=True)
    interventions = ("sink_masking",)
    #: the data's label set and image transforms: from the DataModule in ``setup``, or from the checkpoint
    class_map: ClassMap | None = None
    augment: ImageAugment | None = None

    def __init__(
        self,
        model: ViTConfig = ViTConfig(),
        lr: float = 5e-4,
        lr_reference_batch: int | None = 512,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 5.0,
        min_lr: float = 1e-5,
        label_smoothing: float = 0.1,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mixup_switch_prob: float = 0.5,
        ema_decay: float | None = None,
        head_lr_mult: float = 1.0,
        reweighting_lr_mult: float = 1.0,
        layer_decay: float | None = None,
        freeze_backbone_epochs: int = 0,
        compile: CompileOption = False,
    ):
        super().__init__()
        if layer_decay is not None and not 0 < layer_decay <= 1:
            raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
        if not (head_lr_mult >= 0 and reweighting_lr_mult >= 0):
            raise ValueError(
                f"learning-rate multipliers must be >= 0, got head_lr_mult {head_lr_mult}, "
                f"reweighting_lr_mult {reweighting_lr_mult}"
            )
        if freeze_backbone_epochs < 0:
            raise ValueError(f"freeze_backbone_epochs must be >= 0, got {freeze_backbone_epochs}")
        self.save_hyperparameters()
        self.model = ReweightedViT(model)
        self.compiled = CompiledCalls(compile, self.model)
        if self.model.pretrained_report is not None:
            rank_zero_info(self.model.pretrained_report.summary())
        num_classes = model.num_classes
        self.mixup = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            self.mixup = Mixup(
                mixup_alpha=mixup_alpha,
                cutmix_alpha=cutmix_alpha,
                switch_prob=mixup_switch_prob,
                label_smoothing=label_smoothing,
                num_classes=num_classes,
            )
            self.soft_ce = SoftTargetCrossEntropy()
        self.ema = None
        if ema_decay is not None:
            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(ema_decay), use_buffers=True)
            self.ema.requires_grad_(False)  # updated by averaging, never by the optimiser
        self.eval_metrics = nn.ModuleDict({stage: self._metrics(num_classes) for stage in ("val", "test")})

    def _metrics(self, num_classes: int) -> nn.ModuleDict:
        metrics = nn.ModuleDict(
            {
                "loss": MeanMetric(),
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
            }
        )
        if self.ema is not None:
            metrics["ema_top1"] = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        return metrics

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        if isinstance(getattr(datamodule, "class_map", None), ClassMap) and hasattr(datamodule, "augment"):
            self.use_data(datamodule)

    # ------------------------------------------------------------------ class names and transform
    def use_data(self, datamodule) -> None:
        """Take ``datamodule.class_map`` and its image transforms ``datamodule.augment``."""
        class_map, augment = getattr(datamodule, "class_map", None), getattr(datamodule, "augment", None)
        if not isinstance(class_map, ClassMap) or not isinstance(augment, ImageAugment):
            raise TypeError(f"{type(datamodule).__name__} has no class map and image transforms (.class_map, .augment)")
        if len(class_map) != self.model.config.num_classes:
            raise ValueError(
                f"the data has {len(class_map)} classes but model.num_classes is {self.model.config.num_classes}"
            )
        self.class_map, self.augment = class_map, augment

    def data_state(self) -> dict:
        if self.class_map is None:
            return {}
        return {**self.class_map.to_dict(), "augment": dataclasses.asdict(self.augment)}

    def load_data_state(self, state: dict) -> None:
        saved = ClassMap.from_dict(state)
        if self.class_map is not None and self.class_map != saved:
            raise ValueError(
                f"the checkpoint's classes are not the data's ({list(saved.names[:3])}... vs "
                f"{list(self.class_map.names[:3])}...): the model was trained on other data"
            )
        if self.class_map is None:  # a DataModule attached before keeps its transforms
            self.class_map, self.augment = saved, ImageAugment(**state["augment"])

    def classify(self, images: Sequence, top_k: int = 5, batch_size: int = 64) -> list[list[tuple[str, float]]]:
        """The ``top_k`` most probable classes of each image, as ``(class name, probability)`` pairs by
        decreasing probability, with the evaluation transform of the training data's config.

        Args:
            images: PIL images or paths of image files (a list).
            top_k: classes per image (at most the number of classes).
            batch_size: images per forward pass.
        """
        if self.class_map is None:
            raise self.missing("class names and image transforms", "ImageShardDataModule")
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise TypeError("classify takes a list of images or paths; wrap a single one in a list")
        k = min(top_k, len(self.class_map))
        results = []
        with evaluating(self):
            for start in range(0, len(images), batch_size):
                batch = eval_images(list(images[start : start + batch_size]), self.augment).to(device_of(self))
                probs = torch.softmax(self(batch).float(), dim=-1)  # (B, num_classes)
                top = probs.topk(k, dim=-1)
                results += [
                    [(self.class_map.names[c], p) for c, p in zip(idx.tolist(), val.tolist())]
                    for val, idx in zip(top.values, top.indices)
                ]
        return results

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        batch_size = getattr(datamodule, "batch_size", None)
        if self.mixup is not None and batch_size is not None and batch_size % 2:
            raise ValueError(f"mixup/cutmix needs an even per-device batch size, got {batch_size}")
        data_classes = getattr(datamodule, "num_classes", None)
        if data_classes is not None and data_classes != self.model.config.num_classes:
            raise ValueError(
                f"the data has {data_classes} classes but model.num_classes is {self.model.config.num_classes}"
            )

    #: batches hold images, no tokens (:class:`~mmlight.callbacks.Throughput`)
    counts_tokens = False

    def batch_counts(self, batch) -> tuple[int, None]:
        """``(samples, None)`` of a training batch, for the throughput logs."""
        return batch[1].shape[0], None

    def training_loss(self, batch, network: nn.Module) -> torch.Tensor:
        """``network``'s plain training loss on ``batch`` (no mixup), uncompiled: what the throughput
        callback counts FLOPs of, on a meta-device copy of the network."""
        return self._plain_loss(batch, network.loss)

    def _plain_loss(self, batch, loss_fn) -> torch.Tensor:
        """``loss_fn`` (a network's ``loss``, compiled or not) of ``batch``, label-smoothed as configured."""
        images, labels = batch
        return loss_fn(images, labels, label_smoothing=self.hparams.label_smoothing)

    def training_step(self, batch, batch_idx):
        if self.mixup is not None:
            images, targets = self.mixup(*batch)
            loss = self.soft_ce(self.compiled(self.model.forward, images), targets)
        else:
            loss = self._plain_loss(batch, functools.partial(self.compiled, self.model.loss))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        # Discarding gradients (rather than switching requires_grad) keeps DDP's gradient buckets
        # unchanged; the reweighting parameters of every block need the backward pass anyway.
        if self.current_epoch < self.hparams.freeze_backbone_epochs:
            for param in self.backbone_parameters():
                param.grad = None

    def backbone_parameters(self) -> list[nn.Parameter]:
        """The pretrained part: every parameter except the head and the reweighting parameters."""
        new = reweighting_parameter_ids(self.model)
        new |= {id(self.model.get_parameter(name)) for name in self.model.head_parameter_names()}
        return [p for p in self.model.parameters() if id(p) not in new]

    def lr_scales(self) -> dict[str, float]:
        """Learning-rate multiplier of every parameter of ``self.model``, by name."""
        hp = self.hparams
        reweighting = reweighting_parameter_ids(self.model)
        head = self.model.head_parameter_names()
        layers = self.model.layer_ids()
        top = max(layers.values())
        scales = {}
        for name, param in self.model.named_parameters():
            if id(param) in reweighting:
                scales[name] = hp.reweighting_lr_mult
            elif name in head:
                scales[name] = hp.head_lr_mult
            else:
                scales[name] = 1.0 if hp.layer_decay is None else hp.layer_decay ** (top - layers[name])
        return scales

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # Updated here rather than in on_train_batch_end, which runs after the checkpoint callbacks:
        # a checkpoint taken at step k then holds an EMA of exactly k updates.
        self.update_ema()

    def update_ema(self) -> None:
        """One EMA update from the current weights (a no-op without ``ema_decay``)."""
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def _eval_step(self, stage: str, batch) -> None:
        images, labels = batch
        logits = self.compiled(self.model.forward, images)
        metrics = self.eval_metrics[stage]
        metrics["loss"].update(F.cross_entropy(logits, labels), weight=labels.numel())
        metrics["top1"].update(logits, labels)
        metrics["top5"].update(logits, labels)
        if self.ema is not None:
            metrics["ema_top1"].update(self.compiled(self.ema.module.forward, images), labels)

    def _eval_epoch_end(self, stage: str) -> None:
        # compute() syncs across ranks; every rank calls it, also one that saw no batch.
        for name, metric in self.eval_metrics[stage].items():
            self.log(f"{stage}/{name}", metric.compute(), prog_bar=name == "top1")
            metric.reset()

    def predict_step(self, batch, batch_idx):
        """Class probabilities ``(B, num_classes)`` and predicted labels ``(B,)`` for a batch."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        probs = torch.softmax(self(images).float(), dim=-1)
        return {"probs": probs, "pred": probs.argmax(dim=-1)}

    # ------------------------------------------------------------------ attention analysis
    def teacher_forced(self, batch) -> None:
        self.model(batch[0])

    def query_keep(self, batch) -> dict[str, torch.Tensor | None]:
        return {}  # every patch is a real position

    def example_inputs(self, batch) -> ExampleInputs:
        vit = self.model.vit
        return ExampleInputs(
            image=batch[0],
            patch_grid=tuple(vit.patch_embed.grid_size),
            prefix=vit.num_prefix_tokens,
            cam_layer=vit.blocks[-1].norm1,
        )

    def metric_evaluation(self, split: str, scratch):
        return nullcontext()  # validate and test both log top1 and write nothing

    def configure_optimizers(self):
        hp = self.hparams
        lr = hp.lr
        if hp.lr_reference_batch:
            lr = lr * self._global_batch_size() / hp.lr_reference_batch
        groups = param_groups(self.model, hp.weight_decay, self.lr_scales().__getitem__)
        for group in groups:
            group["lr"] = lr * group["lr_scale"]
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=hp.betas)
        total = int(self.trainer.estimated_stepping_batches)
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else None
        steps_per_epoch = math.ceil(total / epochs) if epochs else total
        warmup = min(total, round(hp.warmup_epochs * steps_per_epoch))
        scheduler = warmup_cosine(optimizer, warmup, total, min_lr_ratio=min(1.0, hp.min_lr / lr))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _global_batch_size(self) -> int:
        batch_size = getattr(self.trainer.datamodule, "batch_size", None)
        if batch_size is None:
            raise ValueError(
                "lr_reference_batch needs a datamodule with a batch_size attribute; "
                "set model.lr_reference_batch: null to use lr as given"
            )
        return batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches
