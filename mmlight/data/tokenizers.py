"""Moses tokenisation and BPE of the translation data, shared by ``mmlight prepare iwslt14``,
``TranslationDataModule.encode`` (predicting raw text) and ``decode`` (hypotheses and references).

:func:`moses_tokenize` must give the tokens of fairseq's ``prepare-iwslt14.sh``, which runs Moses'
``tokenizer.perl``. sacremoses ports that script with one rule missing: the Perl script always splits
the period off the *last* word of a line (its comment: last words are unlikely to be non-breaking
prefixes), while sacremoses keeps it attached when the word looks like an abbreviation (``u.s.a.``),
is a listed non-breaking prefix (``usw.``, a single letter ``T.``, in German a number ``3.``).
:func:`split_final_period` adds that rule at the point where the Perl script applies it.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

#: what the tokenised text depends on besides the raw text (kept with cached tokenisations).
TOKENIZER = f"sacremoses {version('sacremoses')} + tokenizer.perl final period"
#: separator subword-nmt appends to a subword that continues in the next one.
BPE_SEPARATOR = "@@ "


def split_final_period(text: str) -> str:
    r"""``tokenizer.perl``'s rule for the last word: one matching ``/^(\S+)\.$/`` becomes ``$1 .``,
    whatever the non-breaking prefix lists say.

    Args:
        text: a line's words joined by single spaces, as sacremoses has them after its own
            non-breaking-prefix step (multi-dots are still ``DOTMULTI`` placeholders there, so
            ``wait...`` is left alone).
    """
    head, space, last = text.rpartition(" ")
    if len(last) > 1 and last.endswith("."):
        return f"{head}{space}{last[:-1]} ."
    return text


def _perl_compatible_tokenizer(lang: str):
    """A sacremoses ``MosesTokenizer`` whose non-breaking-prefix step ends with :func:`split_final_period`,
    the place where ``tokenizer.perl`` applies it (sacremoses is imported on first use: it is slow to load)."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    sacremoses_rule = tokenizer.handles_nonbreaking_prefixes
    tokenizer.handles_nonbreaking_prefixes = lambda text: split_final_period(sacremoses_rule(text))
    return tokenizer


_TOKENIZERS: dict = {}
_DETOKENIZERS: dict = {}
_BPES: dict = {}


def moses_tokenize(line: str, lang: str) -> str:
    """Moses-tokenise one line like ``tokenizer.perl -l lang`` (escaping on), then lowercase."""
    if lang not in _TOKENIZERS:
        _TOKENIZERS[lang] = _perl_compatible_tokenizer(lang)
    return _TOKENIZERS[lang].tokenize(line, escape=True, return_str=True).lower()


def moses_detokenize(text: str, lang: str) -> str:
    """Undo :func:`moses_tokenize`'s spacing and escaping (``detokenizer.perl -l lang``)."""
    if lang not in _DETOKENIZERS:
        from sacremoses import MosesDetokenizer

        _DETOKENIZERS[lang] = MosesDetokenizer(lang=lang)
    return _DETOKENIZERS[lang].detokenize(text.split())


def apply_bpe(line: str, codes: str) -> str:
    """Segment a tokenised line with subword-nmt codes (the text of a codes file; ``@@ `` separators)."""
    if codes not in _BPES:
        import io

        from subword_nmt.apply_bpe import BPE

        _BPES[codes] = BPE(io.StringIO(codes))
    return _BPES[codes].process_line(line)


def remove_bpe(text: str) -> str:
    """Join BPE subwords back into words (fairseq's ``--remove-bpe``)."""
    return (text + " ").replace(BPE_SEPARATOR, "").rstrip()


def count_bpe_merges(codes: Path) -> int:
    """Merge operations in a subword-nmt codes file (its ``#version`` header is not one)."""
    return sum(
        1 for line in codes.read_text(encoding="utf-8").splitlines() if line.strip() and not line.startswith("#")
    )
