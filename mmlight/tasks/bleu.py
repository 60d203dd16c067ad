"""Corpus BLEU the two ways the IWSLT14 literature reports it, both computed by sacreBLEU.

* ``bleu``: sacreBLEU's default (13a tokenisation of detokenised text, case-sensitive), reported with
  its signature (Post, 2018; the paper's Table 4).
* ``bleu_tok``: "tokenised BLEU" as fairseq's ``generate.py --remove-bpe`` prints it: the Moses-tokenised,
  lowercased, BPE-removed text scored with no further tokenisation (``-tok none -lc``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sacrebleu.metrics import BLEU


@dataclass(frozen=True)
class BleuScores:
    """Both scores with sacreBLEU's signatures (which name tokenisation, case, smoothing and version)."""

    bleu: float
    signature: str
    bleu_tok: float
    signature_tok: str
    sentences: int

    def as_dict(self) -> dict:
        return asdict(self)


def corpus_bleu(
    hypotheses: list[str], references: list[str], hypotheses_tok: list[str], references_tok: list[str]
) -> BleuScores:
    """Score detokenised ``hypotheses`` against ``references`` and the tokenised lowercased
    ``hypotheses_tok`` against ``references_tok`` (one reference per sentence, same order)."""
    lengths = {len(hypotheses), len(references), len(hypotheses_tok), len(references_tok)}
    if len(lengths) != 1:
        raise ValueError(f"hypotheses and references differ in length: {sorted(lengths)}")
    detok = BLEU()
    tok = BLEU(tokenize="none", lowercase=True, force=True)  # tokenised on purpose: no "forgot to detokenize" warning
    return BleuScores(
        bleu=detok.corpus_score(hypotheses, [references]).score,
        signature=str(detok.get_signature()),
        bleu_tok=tok.corpus_score(hypotheses_tok, [references_tok]).score,
        signature_tok=str(tok.get_signature()),
        sentences=len(hypotheses),
    )
