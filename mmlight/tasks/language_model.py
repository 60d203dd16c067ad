"""Language modelling (fairseq ``transformer_lm`` on WikiText-103, the paper's Section 5.1.2) with a
swappable attention reweighting and an optional MultiMax output layer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import SumMetric

from mmlight.data.text import EvalWindows
from mmlight.models.transformer import TransformerConfig, TransformerLM
from mmlight.tasks.compiling import CompiledCalls, CompileOption
from mmlight.tasks.inference import device_of, evaluating
from mmlight.tasks.protocol import ExampleInputs, TaskMetric
from mmlight.tasks.sequence import AdamRecipe, SequenceTask


class TextScore(NamedTuple):
    """The score of one text: ``log_prob`` (natural log) of its ``tokens`` scored tokens."""

    log_prob: float
    tokens: int


class LanguageModel(SequenceTask):
    """Trains a :class:`~mmlight.models.TransformerLM` on batches ``{input, target, loss_mask}``
    (:class:`~mmlight.data.WikiTextDataModule`, :class:`~mmlight.data.RecallDataModule`).

    Evaluation logs ``{stage}/loss`` (NLL per scored token, nats) and ``{stage}/ppl`` over the whole
    split from summed NLL and token counts synced across ranks. On WikiText every word and every
    end-of-line ``</s>`` is a scored token, so this is fairseq's per-word perplexity; the context each
    token is scored with is the DataModule's ``eval_block_size``/``eval_context``. No softmax over
    ``(B, T, V)`` is kept for the metric: the loss goes through the (fused) cross-entropy.
    From Python, :meth:`score` gives the log-probability of raw texts with the checkpoint's vocabulary.

    Args:
        model: the architecture (e.g. the ``transformer_lm_wikitext103`` preset's fields).
        accuracy: also report ``{stage}/acc``, the fraction of scored targets predicted exactly
            (argmax). It materialises the logits of the scored positions, so leave it off for a
            267k-word vocabulary; the associative-recall quick start turns it on.
        compile: compile the network's training and evaluation forward with ``torch.compile``:
            ``true``, or its keyword arguments; see :mod:`mmlight.tasks.compiling`.
        recipe: the fields of :class:`~mmlight.tasks.sequence.AdamRecipe` (fairseq's ``transformer_lm``
            recipe by default: weight decay 0.01, no label smoothing).
    """

    interventions = ("sink_masking", "kv_eviction")
    datamodule_name = "WikiTextDataModule"

    def __init__(self, model: TransformerConfig, *, accuracy: bool = False, compile: CompileOption = False, **recipe):
        built = AdamRecipe(**recipe)
        recipe = asdict(built)  # the whole recipe, defaults included, is saved as hyperparameters
        super().__init__(built)
        self.save_hyperparameters()
        self.model = TransformerLM(model)
        self.compiled = CompiledCalls(compile, self.model)
        if accuracy:
            self.correct = nn.ModuleDict({stage: SumMetric() for stage in ("val", "test")})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token scores ``(B, T, V)`` of ``tokens`` ``(B, T)``."""
        return self.model.logits(self.model(tokens))

    def batch_counts(self, batch) -> tuple[int, int]:
        """``(sequences, scored tokens)`` of a training batch, for the throughput logs."""
        return batch["input"].shape[0], int(batch["loss_mask"].sum())

    def summed_training_loss(self, batch, loss: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed loss, scored-token count)`` of a training batch by ``loss`` (a network's ``loss``)."""
        return loss(batch["input"], batch["target"], batch["loss_mask"], label_smoothing=self.recipe.label_smoothing)

    def training_step(self, batch, batch_idx):
        loss, _ = self.mean_training_loss(batch, functools.partial(self.compiled, self.model.loss))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, stage: str, batch) -> None:
        hidden = self.compiled(self.model.forward, batch["input"])  # (B, T, d)
        nll_sum, count = self.compiled(self.model.summed_loss, hidden, batch["target"], batch["loss_mask"])
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
        rows = [
            self.model.summed_loss(hidden[b : b + 1], batch["target"][b : b + 1], batch["loss_mask"][b : b + 1])
            for b in range(hidden.shape[0])
        ]
        return {"nll": torch.stack([nll for nll, _ in rows]), "tokens": torch.stack([n for _, n in rows])}

    # ------------------------------------------------------------------ attention analysis
    @property
    def task_metric(self) -> TaskMetric:
        """Accuracy when the task reports it (the recall quick start, whose headline metric it is),
        otherwise perplexity."""
        if self.hparams.accuracy:
            return TaskMetric("acc", higher_is_better=True)
        return TaskMetric("ppl", higher_is_better=False)

    def teacher_forced(self, batch) -> None:
        self.model(batch["input"])

    def query_keep(self, batch) -> dict[str, torch.Tensor | None]:
        return {"decoder": batch["input"] != self.config.pad_id}

    def example_inputs(self, batch) -> ExampleInputs:
        return ExampleInputs(tokens={"decoder": batch["input"]})

    def metric_evaluation(self, split: str, scratch):
        return nullcontext()  # validate and test both log ppl and write nothing

    def score(
        self,
        texts: Sequence[str],
        block_size: int | None = None,
        context: int = 0,
        joined: bool = False,
        batch_size: int = 8,
    ) -> list[TextScore]:
        """Log-probability of each text and the number of tokens scored: its words (split on
        whitespace, unknown ones as ``<unk>``) and the ``</s>`` that ends it, as WikiText's evaluation
        counts a line. ``exp(-sum(log_prob) / sum(tokens))`` is the perplexity over the texts.

        Each text is scored on its own, its first token predicted from ``</s>``; with ``joined`` the
        texts are one running text, line after line, as a prepared split's token stream, so a text is
        scored with the texts before it as context. A stream longer than ``block_size`` is scored in
        the windows ``mmlight test`` uses (:func:`mmlight.data.text.eval_windows`): with the
        DataModule's ``eval_block_size`` and ``eval_context``, the lines of a split, ``joined``, give
        the NLL and token count of ``mmlight test``'s ``test/ppl``.

        Args:
            texts: the texts (a list of strings, e.g. lines).
            block_size: window length; None is the model's ``max_positions``.
            context: tokens of context of every window after the first (``eval_context``).
            joined: score the texts as one running text instead of each on its own.
            batch_size: windows per forward pass.
        """
        vocab = self.require_vocab()
        if isinstance(texts, str):
            raise TypeError("score takes a list of texts; wrap a single one in a list")
        block_size = block_size or self.config.max_positions
        if block_size > self.config.max_positions:
            raise ValueError(f"block_size={block_size} is over the model's max_positions={self.config.max_positions}")
        ids = [vocab.encode(text) + [vocab.eos_id] for text in texts]
        streams = [list(range(len(ids)))] if joined else [[i] for i in range(len(ids))]
        log_probs = torch.zeros(len(ids), dtype=torch.float64)
        with evaluating(self):
            for members in streams:
                self._score_stream(
                    [ids[i] for i in members], torch.tensor(members), log_probs, block_size, context, batch_size
                )
        return [TextScore(float(lp), len(x)) for lp, x in zip(log_probs, ids)]

    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> list[str]:
        """Continue each prompt by up to ``max_new_tokens`` tokens and return the continuations as text
        (the prompt not repeated). Decoding is incremental: the prompt goes through the network once,
        filling the KV cache (:meth:`~mmlight.models.TransformerLM.new_cache`), then each new token
        alone. A prompt starts after ``</s>``, as :meth:`score` scores a text, and its continuation
        ends early at ``</s>`` (not returned). ``<pad>`` is never chosen (it is never a target).

        Each prompt is decoded on its own (batch of one), so its text does not depend on the others.

        Args:
            prompts: the texts to continue (a list of strings).
            max_new_tokens: the most tokens generated per prompt (0 gives empty strings).
            temperature: 0 is greedy (the most probable token each step); above 0, tokens are sampled
                from ``softmax(logits / temperature)``.
            top_k: with sampling, draw only from the ``top_k`` most probable tokens; None: from all.
            seed: seed of the sampling generator, so a call is repeatable; None draws a fresh one.
        """
        vocab = self.require_vocab()
        if isinstance(prompts, str):
            raise TypeError("generate takes a list of prompts; wrap a single one in a list")
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(
                f"need max_new_tokens >= 0, temperature >= 0 and top_k >= 1 or None, got {max_new_tokens}, "
                f"{temperature} and {top_k}"
            )
        ids = [[vocab.eos_id, *vocab.encode(prompt)] for prompt in prompts]
        longest = max((len(x) for x in ids), default=0) + max_new_tokens - 1
        if self.config.positions in ("learned", "sinusoidal") and longest > self.config.max_positions:
            raise ValueError(
                f"a prompt and its continuation need {longest} positions, over the model's "
                f"max_positions={self.config.max_positions}: shorten the prompt or lower max_new_tokens"
            )
        device = device_of(self)
        generator = torch.Generator(device=device)
        generator.manual_seed(torch.seed() if seed is None else seed)
        with evaluating(self):
            new = [self._continue(x, max_new_tokens, temperature, top_k, generator, device) for x in ids]
        return [vocab.decode(x) for x in new]

    def _continue(
        self,
        ids: list[int],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        generator: torch.Generator,
        device: torch.device,
    ) -> list[int]:
        """Up to ``max_new_tokens`` ids after ``ids`` (stopping before ``</s>``), decoded through the cache."""
        cache = self.model.new_cache()
        step = torch.tensor([ids], device=device)  # (1, T): the prompt, then one new token a step
        new: list[int] = []
        while len(new) < max_new_tokens:
            logits = self.model.logits(self.model(step, cache=cache)[:, -1]).float()  # (1, V)
            logits[:, self.vocab.pad_id] = -torch.inf
            token = int(next_token(logits, temperature, top_k, generator))
            if token == self.vocab.eos_id:
                break
            new.append(token)
            step = torch.tensor([[token]], device=device)
        return new

    def _score_stream(
        self,
        texts: list[list[int]],
        members: torch.Tensor,
        log_probs: torch.Tensor,
        block_size: int,
        context: int,
        batch_size: int,
    ) -> None:
        """Add the log-probability of each token of the stream ``texts`` (id lists, concatenated) to
        ``log_probs[members[k]]``, ``k`` the text the token belongs to."""
        owner = torch.repeat_interleave(members, torch.tensor([len(t) for t in texts]))  # stream position -> text
        stream = np.concatenate(texts)
        windows = EvalWindows(stream, block_size, context, batch_size, self.vocab.pad_id, self.vocab.eos_id)
        device = device_of(self)
        for batch in windows:
            hidden = self.model(batch["input"].to(device))  # (B, T, d)
            scored = batch["loss_mask"]  # (B, T)
            positions = (batch["start"][:, None] + torch.arange(scored.shape[1]))[scored]  # (N,) in the stream
            logits = self.model.logits(hidden[scored.to(device)]).float()  # (N, V)
            nll = F.cross_entropy(logits, batch["target"][scored].to(device), reduction="none")  # (N,)
            log_probs.index_add_(0, owner[positions], -nll.double().cpu())


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """The next token ``(B,)`` from ``logits`` ``(B, V)``: the argmax at ``temperature`` 0, else a draw
    from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (all when None)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest logit
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
