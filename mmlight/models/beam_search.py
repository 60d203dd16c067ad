"""Batched beam search for :class:`~mmlight.models.transformer.TransformerSeq2Seq` with the semantics of
fairseq's ``SequenceGenerator`` (the IWSLT evaluation of the paper's Section 5.1.3).

Each sentence keeps ``K`` beams. A step decodes one token per beam through the model's KV cache, takes
the ``2K`` best (beam, token) continuations of each sentence, finalises those ending in ``</s>`` that
rank among the first ``K`` (score = summed log-probs / ``length ** length_penalty``, ``</s>`` counted)
and carries the ``K`` best others on. A sentence stops once it has ``K`` finalised hypotheses or at its
maximum length, where every beam is forced to ``</s>``; finished sentences leave the batch.

Shapes: ``B`` sentences, ``N`` of them unfinished, ``K`` beams, ``V`` target vocabulary, ``S`` source
tokens, ``t`` target tokens so far (the start token included), ``L`` the longest allowed output.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmlight.models.transformer import TransformerSeq2Seq
from mmlight.safe_load import checkpoint_record


@checkpoint_record
@dataclass
class BeamSearchConfig:
    """Search settings, named after fairseq's ``generate`` options.

    Args:
        beam_size: beams per sentence (``--beam``); also the number of finalised hypotheses after
            which a sentence stops.
        max_len_a: a sentence gets at most ``int(max_len_a * src_len + max_len_b)`` tokens before
            ``</s>``, ``src_len`` its real (unpadded) source length (``--max-len-a``).
        max_len_b: the constant of that bound (``--max-len-b``).
        length_penalty: a finalised hypothesis scores its summed log-probs divided by
            ``length ** length_penalty``, the length counting the final ``</s>`` (``--lenpen``);
            0 ranks by summed log-probs, larger values favour longer outputs.
        min_len: fewest tokens before ``</s>`` (``--min-len``); the maximum length wins when smaller.
    """

    beam_size: int = 5
    max_len_a: float = 1.2
    max_len_b: int = 10
    length_penalty: float = 1.0
    min_len: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for a setting the search cannot use."""
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise ValueError(f"max_len_a and max_len_b must be >= 0, got {self.max_len_a} and {self.max_len_b}")
        if self.min_len < 0:
            raise ValueError(f"min_len must be >= 0, got {self.min_len}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")


@dataclass
class _Finalised:
    """The best finalised hypothesis of every sentence, and how many each has finalised.

    Args:
        counts: ``(B,)`` finalised hypotheses so far.
        scores: ``(B,)`` length-normalised score of the best, -inf while there is none.
        lengths: ``(B,)`` its token count (without start token and ``</s>``).
        tokens: ``(B, L)`` its tokens in the first ``lengths`` columns.
    """

    counts: torch.Tensor
    scores: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def empty(cls, batch: int, max_len: int, device: torch.device) -> _Finalised:
        return cls(
            counts=torch.zeros(batch, dtype=torch.long, device=device),
            scores=torch.full((batch,), -math.inf, dtype=torch.float32, device=device),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
            tokens=torch.zeros(batch, max_len, dtype=torch.long, device=device),
        )

    def add(self, alive, cand_scores, cand_beams, ends, tokens, length_penalty) -> None:
        """Count the hypotheses ending at this step and keep the best of each sentence if it improves.

        Args:
            alive: ``(N,)`` sentence index of each unfinished sentence.
            cand_scores: ``(N, K)`` summed log-probs of the first ``K`` candidates.
            cand_beams: ``(N, K)`` their beams.
            ends: ``(N, K)`` bool, the candidates finalised now (``</s>``, finite score).
            tokens: ``(N*K, t)`` the beams' tokens, start token first.
            length_penalty: the exponent of the length (``t``, the ``</s>`` counted) dividing the score.
        """
        N, K, t = cand_scores.shape[0], cand_scores.shape[1], tokens.shape[1]
        self.counts[alive] += ends.sum(1)
        normalised = (cand_scores / t**length_penalty).masked_fill(~ends, -math.inf)  # (N, K)
        score, pos = normalised.max(1)  # (N,)
        better = score > self.scores[alive]  # (N,)
        beam = cand_beams.gather(1, pos[:, None])[:, 0]  # (N,)
        hyp = tokens.view(N, K, t)[torch.arange(N, device=tokens.device), beam, 1:]  # (N, t - 1)
        self.tokens[alive, : t - 1] = torch.where(better[:, None], hyp, self.tokens[alive, : t - 1])
        self.lengths[alive] = torch.where(better, t - 1, self.lengths[alive])
        self.scores[alive] = torch.where(better, score, self.scores[alive])


def max_lengths(src_mask: torch.Tensor, config: BeamSearchConfig, max_positions: int) -> torch.Tensor:
    """``(B,)`` most tokens before ``</s>`` per sentence: ``int(max_len_a * src_len + max_len_b)`` of its
    real source length, capped by ``max_positions - 1`` (the start token holds position 0)."""
    src_lens = src_mask.sum(1).tolist()
    lens = [min(int(config.max_len_a * n + config.max_len_b), max_positions - 1) for n in src_lens]
    return torch.tensor(lens, dtype=torch.long, device=src_mask.device)


@torch.no_grad()
def beam_search(
    model: TransformerSeq2Seq,
    src: torch.Tensor,
    src_mask: torch.Tensor | None,
    config: BeamSearchConfig,
    *,
    start_id: int,
    eos_id: int,
    pad_id: int,
    banned_ids: Sequence[int] = (),
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Translate a batch with beam search; the model should be in eval mode.

    Args:
        model: the encoder-decoder.
        src: ``(B, S)`` int64 source tokens.
        src_mask: ``(B, S)`` bool, True = real token; None = the model's ``source_mask(src)``.
        config: beam size, length bounds, length penalty.
        start_id: first decoder input (fairseq: ``</s>``, i.e. ``eos_id``).
        eos_id: the token that ends a hypothesis.
        pad_id: never generated.
        banned_ids: further tokens never generated (the Translator bans ``<s>``).

    Returns:
        ``(hypotheses, scores)``: ``hypotheses[b]`` the best hypothesis of sentence ``b``, a 1-D int64
        tensor without the start token and the final ``</s>``; ``scores`` ``(B,)`` float32 its
        length-normalised score.
    """
    _check_arguments(model, src, src_mask, config, start_id, eos_id, pad_id, banned_ids)
    B, K, device = src.shape[0], config.beam_size, src.device
    if B == 0:
        return [], torch.empty(0, dtype=torch.float32, device=device)
    src_mask = model.source_mask(src) if src_mask is None else src_mask
    max_len = max_lengths(src_mask, config, model.config.max_positions)  # (B,)
    vocab = torch.arange(model.config.vocab_size, device=device)  # (V,)
    banned = (vocab == pad_id) | torch.isin(vocab, torch.tensor(list(banned_ids), dtype=torch.long, device=device))
    is_eos = vocab == eos_id  # (V,)

    memory = model.encode(src, src_mask).repeat_interleave(K, 0)  # (B*K, S, d)
    src_mask = src_mask.repeat_interleave(K, 0)  # (B*K, S)
    cache = model.new_cache()
    alive = torch.arange(B, device=device)  # (N,) sentence of each unfinished sentence
    tokens = torch.full((B * K, 1), start_id, dtype=torch.long, device=device)  # (N*K, t)
    scores = torch.zeros(B, K, dtype=torch.float32, device=device)  # (N, K) summed log-probs; beam 0 alone at first
    scores[:, 1:] = -math.inf
    scores = scores.view(-1)  # (N*K,)
    finalised = _Finalised.empty(B, int(max_len.max()), device)

    for step in itertools.count():
        hidden = model.decode(tokens[:, -1:], memory, src_mask, cache)  # (N*K, 1, d)
        lprobs = torch.log_softmax(model.logits(hidden[:, -1]).float(), -1)  # (N*K, V)
        row_max_len = max_len[alive].repeat_interleave(K)  # (N*K,)
        allowed = _allowed_tokens(banned, is_eos, step, config.min_len, row_max_len)  # (N*K, V)
        cand_scores, cand_beams, cand_tokens = _top_candidates(scores, lprobs.masked_fill(~allowed, -math.inf), K)

        ends = (cand_tokens[:, :K] == eos_id) & cand_scores[:, :K].isfinite()  # (N, K)
        finalised.add(alive, cand_scores[:, :K], cand_beams[:, :K], ends, tokens, config.length_penalty)
        unfinished = (finalised.counts[alive] < K) & (step < max_len[alive])  # (N,)
        if not unfinished.any():
            break

        scores, beams, next_tokens = _continuations(cand_scores, cand_beams, cand_tokens, K, eos_id)  # (N, K)
        rows = torch.arange(alive.shape[0], device=device)[:, None] * K + beams  # (N, K) rows of tokens
        rows, scores, next_tokens = rows[unfinished].view(-1), scores[unfinished].view(-1), next_tokens[unfinished]
        model.reorder_cache(cache, rows)
        tokens = torch.cat([tokens[rows], next_tokens.view(-1, 1)], dim=1)  # (N'*K, t + 1)
        if rows.shape[0] < memory.shape[0]:  # sentences finished: drop their rows
            memory, src_mask = memory[rows], src_mask[rows]
        alive = alive[unfinished]

    lengths = finalised.lengths.tolist()
    return [finalised.tokens[b, :n] for b, n in enumerate(lengths)], finalised.scores


def _allowed_tokens(banned, is_eos, step: int, min_len: int, max_len: torch.Tensor) -> torch.Tensor:
    """``(N*K, V)`` bool, the tokens a beam may take at ``step`` (0-based): never ``banned`` ``(V,)``,
    ``</s>`` (``is_eos`` ``(V,)``) from ``min_len`` on, and only ``</s>`` once ``step`` reaches the
    row's ``max_len`` ``(N*K,)``."""
    allowed = ~banned & ~(is_eos & (step < min_len))  # (V,)
    return torch.where((step >= max_len)[:, None], is_eos, allowed)  # (N*K, V)


def _top_candidates(scores: torch.Tensor, lprobs: torch.Tensor, K: int):
    """The ``2K`` best continuations of each sentence, best first, from the beams' summed log-probs
    ``scores`` ``(N*K,)`` and next-token log-probs ``lprobs`` ``(N*K, V)``: their summed log-probs,
    beams and tokens, each ``(N, 2K)``."""
    V = lprobs.shape[1]
    total = (scores[:, None] + lprobs).view(-1, K * V)  # (N, K*V)
    top, index = total.topk(2 * K, dim=1)  # (N, 2K)
    return top, index // V, index % V


def _continuations(cand_scores, cand_beams, cand_tokens, K: int, eos_id: int):
    """The ``K`` best candidates ``(N, 2K)`` not ending in ``</s>`` (there are at least ``K``: one
    ``</s>`` per beam): their scores, beams and tokens, each ``(N, K)``. A dead continuation (-inf,
    taken only when a sentence has fewer than ``K`` live ones) is fed ``</s>``, never padding."""
    pos = torch.sort((cand_tokens == eos_id).int(), dim=1, stable=True).indices[:, :K]  # (N, K)
    scores, beams, tokens = cand_scores.gather(1, pos), cand_beams.gather(1, pos), cand_tokens.gather(1, pos)
    return scores, beams, torch.where(scores.isfinite(), tokens, eos_id)


def _check_arguments(model, src, src_mask, config, start_id, eos_id, pad_id, banned_ids) -> None:
    """Raise ValueError for inputs :func:`beam_search` cannot use."""
    config.validate()
    if src.dim() != 2:
        raise ValueError(f"src must be (B, S), got shape {tuple(src.shape)}")
    if src.shape[0] and not src.shape[1]:
        raise ValueError("src has no source positions (S == 0)")
    if src_mask is not None and (src_mask.shape != src.shape or src_mask.dtype != torch.bool):
        raise ValueError(
            f"src_mask must be a bool tensor of src's shape {tuple(src.shape)}, "
            f"got {src_mask.dtype} {tuple(src_mask.shape)}"
        )
    V = model.config.vocab_size
    named = [("start_id", start_id), ("eos_id", eos_id), ("pad_id", pad_id)] + [("banned_ids", i) for i in banned_ids]
    for name, i in named:
        if not 0 <= i < V:
            raise ValueError(f"{name} {i} is outside the vocabulary of {V} tokens")
    if eos_id == pad_id or eos_id in banned_ids:
        raise ValueError(f"eos_id {eos_id} must be neither pad_id nor banned")
    if len({pad_id, eos_id, *banned_ids}) >= V:
        raise ValueError("pad_id, eos_id and banned_ids leave no token to generate")
