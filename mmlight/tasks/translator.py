"""Machine translation (fairseq ``transformer_iwslt_de_en`` on IWSLT14 de-en, the paper's Section 5.1.3)
with a swappable reweighting in every encoder, decoder and cross-attention layer."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mmlight.data.translation import collate, decoder_start_id, source_sample
from mmlight.models.beam_search import BeamSearchConfig, beam_search
from mmlight.models.transformer import TransformerConfig, TransformerSeq2Seq
from mmlight.tasks.bleu import corpus_bleu
from mmlight.tasks.compiling import CompiledCalls, CompileOption
from mmlight.tasks.inference import device_of, evaluating
from mmlight.tasks.protocol import ExampleInputs, TaskMetric
from mmlight.tasks.sequence import AdamRecipe, SequenceTask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TranslationRecipe(AdamRecipe):
    """:class:`~mmlight.tasks.sequence.AdamRecipe` with the defaults of fairseq's IWSLT14 de-en example:
    weight decay 1e-4, label smoothing 0.1, and a cosine floor of 1e-9."""

    weight_decay: float = 1e-4
    min_lr: float = 1e-9
    label_smoothing: float = 0.1


class Translator(SequenceTask):
    """Trains a :class:`~mmlight.models.TransformerSeq2Seq` on the batches of
    :class:`~mmlight.data.TranslationDataModule` and translates with beam search.

    * Training: label-smoothed cross-entropy per target token (fairseq normalises by the batch's
      target tokens too).
    * Validation: ``val/loss`` (NLL per target token, nats) and ``val/ppl``; with
      ``bleu_in_validation`` also ``val/bleu`` and ``val/bleu_tok`` from beam search (fairseq's
      ``--eval-bleu``, used to pick the best checkpoint).
    * Test: the same plus BLEU, and the hypotheses written to ``output_dir`` as ``test.hyp``
      (detokenised, in the split's order), ``test.hyp.tok`` (tokenised, lowercased, BPE removed),
      the references ``test.ref``/``test.ref.tok`` and ``test.bleu.json`` (both scores, signatures).
    * Predict: translations of the DataModule's ``src_file`` (or test split), in line order, written to
      ``output_dir/predict.hyp`` (and ``predict.hyp.tok``).

    * From Python: :meth:`translate` (raw sentences in, detokenised translations out), with the
      vocabulary, tokenisation and BPE kept in the checkpoint.

    BLEU and the files cover every rank's sentences: the decoded strings are gathered to every rank.
    References are the stored target text with BPE removed and Moses-detokenised; the shards keep the
    lowercased tokenised text, so the detokenised score is over lowercased text.

    Args:
        model: the architecture (e.g. the ``transformer_iwslt_de_en`` preset's fields).
        beam: beam size, length penalty and maximum length relative to the source.
        bleu_in_validation: also decode the validation split with beam search and report BLEU.
        output_dir: folder for the hypotheses files; None = the run's log directory.
        compile: compile the network's training and teacher-forced evaluation forward with
            ``torch.compile``: ``true``, or its keyword arguments; beam search runs uncompiled. See
            :mod:`mmlight.tasks.compiling`.
        recipe: the fields of :class:`TranslationRecipe` (fairseq's IWSLT14 example by default).
    """

    task_metric = TaskMetric("bleu", higher_is_better=True)
    # beam search decodes through the KV cache, one token a step: evicting in the decoder self-attention
    # is what a compressed cache does to the translation
    interventions = ("sink_masking", "kv_eviction")
    datamodule_name = "TranslationDataModule"

    def __init__(
        self,
        model: TransformerConfig,
        *,
        beam: BeamSearchConfig = BeamSearchConfig(),
        bleu_in_validation: bool = False,
        output_dir: str | None = None,
        compile: CompileOption = False,
        **recipe,
    ):
        built = TranslationRecipe(**recipe)
        recipe = asdict(built)  # the whole recipe, defaults included, is saved as hyperparameters
        super().__init__(built)
        self.save_hyperparameters()
        self.model = TransformerSeq2Seq(model)
        self.compiled = CompiledCalls(compile, self.model)
        # a plain dict when restored from a checkpoint's hyperparameters or given by the CLI
        self.beam = beam if isinstance(beam, BeamSearchConfig) else BeamSearchConfig(**beam)
        self.translations: dict[str, list[dict]] = {}
        # read by evaluation (not from hparams), so that generation_settings() can change them for a while
        self.bleu_in_validation, self.output_dir = bleu_in_validation, output_dir

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token scores ``(B, T, V)`` of the decoder inputs ``tgt_in`` given ``src``."""
        return self.model.logits(self.model(src, tgt_in, src_mask))

    def batch_counts(self, batch) -> tuple[int, int]:
        """``(sentence pairs, target tokens)`` of a training batch, for the throughput logs."""
        return batch["src"].shape[0], int(batch["tgt_mask"].sum())

    def summed_training_loss(self, batch, loss: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed loss, target count)`` of a training batch by ``loss`` (a network's ``loss``)."""
        args = (batch["src"], batch["tgt_in"], batch["tgt_out"], batch["src_mask"], batch["tgt_mask"])
        return loss(*args, label_smoothing=self.recipe.label_smoothing)

    def training_step(self, batch, batch_idx):
        loss, count = self.mean_training_loss(batch, functools.partial(self.compiled, self.model.loss))
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens", count.float(), reduce_fx="sum")
        return loss

    # ------------------------------------------------------------------ generation
    def translate(
        self, sentences: Sequence[str], beam: BeamSearchConfig | None = None, batch_size: int = 32
    ) -> list[str]:
        """Translations of raw source sentences, detokenised, in order: what ``mmlight predict`` writes
        to ``predict.hyp`` for the same lines. Each sentence is tokenised, lowercased and BPE-encoded
        like the training data (the checkpoint's :attr:`vocab`), then decoded by beam search.

        Args:
            sentences: raw source-language sentences (a list; one string per sentence).
            beam: beam settings for this call; None uses :attr:`beam` (which may also be set).
            batch_size: sentences decoded together.
        """
        vocab = self.require_vocab()
        if isinstance(sentences, str):
            raise TypeError("translate takes a list of sentences; wrap a single one in a list")
        samples = [source_sample(i, vocab.encode(text)) for i, text in enumerate(sentences)]
        for s in samples:  # the encoder has no positions beyond max_positions
            if len(s["src"]) + 1 > self.config.max_positions:
                raise ValueError(
                    f"sentence {s['id']} has {len(s['src']) + 1} tokens with </s>, over the model's "
                    f"max_positions={self.config.max_positions}"
                )
        translations = []
        with evaluating(self):
            for start in range(0, len(samples), batch_size):
                batch = collate(
                    samples[start : start + batch_size], vocab.pad_id, vocab.eos_id, decoder_start_id(vocab)
                )
                src, src_mask = batch["src"].to(device_of(self)), batch["src_mask"].to(device_of(self))
                translations += [vocab.decode(ids) for ids in self.generate(src, src_mask, beam)]
        return translations

    @torch.no_grad()
    def generate(
        self, src: torch.Tensor, src_mask: torch.Tensor | None = None, beam: BeamSearchConfig | None = None
    ) -> list[torch.Tensor]:
        """Beam-search translations of ``src`` ``(B, S)``: one id tensor per sentence, without ``</s>``
        (settings ``beam``, or :attr:`beam` when None; special ids from :attr:`vocab`)."""
        vocab = self.require_vocab()
        hypotheses, _ = beam_search(
            self.model,
            src,
            src_mask,
            beam or self.beam,
            start_id=decoder_start_id(vocab),
            eos_id=vocab.eos_id,
            pad_id=self.config.pad_id,
            banned_ids=(vocab.bos_id,),
        )
        return hypotheses

    def _generate(self, stage: str, batch) -> list[dict]:
        """Translate a batch and keep the decoded strings (and references, outside predict)."""
        vocab = self.require_vocab()
        hypotheses = self.generate(batch["src"], batch["src_mask"])
        rows = []
        for b, (sample_id, hyp) in enumerate(zip(batch["ids"].tolist(), hypotheses)):
            row = {"id": sample_id, "hyp": vocab.decode(hyp), "hyp_tok": vocab.decode(hyp, detokenize=False)}
            if stage != "predict":
                row["ref"] = vocab.decode(batch["tgt_out"][b])
                row["ref_tok"] = vocab.decode(batch["tgt_out"][b], detokenize=False)
            rows.append(row)
        self.translations.setdefault(stage, []).extend(rows)
        return rows

    def _finish_generation(self, stage: str) -> list[dict]:
        """Every rank's rows of ``stage`` in id order; logs BLEU (not in predict) and writes the files
        (test and predict, global rank 0)."""
        rows = sorted(gather_to_all(self.translations.pop(stage, [])), key=lambda r: r["id"])
        files = {"hyp": [r["hyp"] for r in rows], "hyp.tok": [r["hyp_tok"] for r in rows]}
        scores = None
        if stage != "predict" and rows:
            files.update({"ref": [r["ref"] for r in rows], "ref.tok": [r["ref_tok"] for r in rows]})
            scores = corpus_bleu(files["hyp"], files["ref"], files["hyp.tok"], files["ref.tok"])
            self.log(f"{stage}/bleu", scores.bleu, prog_bar=True, sync_dist=False)
            self.log(f"{stage}/bleu_tok", scores.bleu_tok, sync_dist=False)
            if self.trainer.is_global_zero:
                log.info(
                    "%s BLEU %.2f (%s); tokenised BLEU %.2f (%s)",
                    stage,
                    scores.bleu,
                    scores.signature,
                    scores.bleu_tok,
                    scores.signature_tok,
                )
        if stage in ("test", "predict"):
            out = Path(self.output_dir or self.trainer.log_dir or ".")  # log_dir broadcasts: all ranks
            if self.trainer.is_global_zero:
                self._write(out, stage, files, scores)
        return rows

    def _write(self, out: Path, stage: str, files: dict[str, list[str]], scores) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for suffix, lines in files.items():
            (out / f"{stage}.{suffix}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        if scores is not None:
            (out / f"{stage}.bleu.json").write_text(json.dumps(scores.as_dict(), indent=2) + "\n")
        print(f"mmlight: {len(files['hyp'])} {stage} translations written to {out / (stage + '.hyp')}")

    # ------------------------------------------------------------------ stages
    def _generates(self, stage: str) -> bool:
        return stage == "test" or self.bleu_in_validation

    @contextmanager
    def generation_settings(self, bleu_in_validation: bool, output_dir: str | None) -> Iterator[None]:
        """Evaluate with these settings (see the class arguments) inside the context; the constructor's
        apply again after it, and the hyperparameters are never changed."""
        saved = self.bleu_in_validation, self.output_dir
        self.bleu_in_validation, self.output_dir = bleu_in_validation, output_dir
        try:
            yield
        finally:
            self.bleu_in_validation, self.output_dir = saved

    def _eval_step(self, stage: str, batch) -> None:
        hidden = self.compiled(self.model.forward, batch["src"], batch["tgt_in"], batch["src_mask"])  # (B, T, d)
        nll_sum, count = self.compiled(self.model.summed_loss, hidden, batch["tgt_out"], batch["tgt_mask"])
        self.update_nll(stage, nll_sum, count)
        if self._generates(stage):
            self._generate(stage, batch)

    def _eval_epoch_end(self, stage: str) -> None:
        self.log_perplexity(stage)
        if self._generates(stage):
            self._finish_generation(stage)

    # ------------------------------------------------------------------ attention analysis
    def teacher_forced(self, batch) -> None:
        self.model(batch["src"], batch["tgt_in"], batch["src_mask"])

    def query_keep(self, batch) -> dict[str, torch.Tensor | None]:
        return {"encoder": batch["src_mask"], "decoder": batch["tgt_in"] != self.config.pad_id}

    def example_inputs(self, batch) -> ExampleInputs:
        return ExampleInputs(tokens={"encoder": batch["src"], "decoder": batch["tgt_in"]})

    def metric_evaluation(self, split: str, scratch):
        # BLEU needs beam search in validation too; a test run's hypotheses files go to the scratch folder
        return self.generation_settings(bleu_in_validation=True, output_dir=str(scratch))

    def predict_step(self, batch, batch_idx):
        """``[{"id", "hyp", "hyp_tok"}, ...]`` for the batch's sentences."""
        return self._generate("predict", batch)

    def on_predict_epoch_end(self) -> None:
        self._finish_generation("predict")


def gather_to_all(rows: list) -> list:
    """Concatenate every rank's ``rows`` (picklable objects) on every rank; ``rows`` when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return [row for part in parts for row in part]
