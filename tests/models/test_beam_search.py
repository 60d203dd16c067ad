"""Beam search against independent references: exhaustive search, greedy decoding, a plain-Python
fairseq beam search and one-sentence-at-a-time decoding, all scoring with full (cache-free) forward passes."""

import dataclasses
import itertools
import math
import re

import pytest
import torch

from mmlight.models.beam_search import BeamSearchConfig, beam_search
from mmlight.models.transformer import TransformerSeq2Seq
from mmlight.reweighting import MultiMax, ReweightingSpec
from tests.helpers.models import tiny_transformer

BOS, PAD, EOS = 0, 1, 2
IDS = {"start_id": EOS, "eos_id": EOS, "pad_id": PAD, "banned_ids": (BOS,)}


def toy_model(seed, vocab=6, attention="softmax", logit_std=0.6, max_positions=16):
    """A tiny random encoder-decoder in float64 whose output distributions are peaked and varied."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    config = tiny_transformer(
        vocab_size=vocab,
        ffn_dim=24,
        n_layers=1,
        n_encoder_layers=1,
        dropout=0.0,
        max_positions=max_positions,
        pad_id=PAD,
        share_output_embedding=False,
        attention=ReweightingSpec(attention),
    )
    model = TransformerSeq2Seq(config).eval()
    with torch.no_grad():
        model.output_projection.weight.normal_(std=logit_std)
        for m in model.modules():
            if isinstance(m, MultiMax):  # away from its near-softmax init
                m.ts.uniform_(-0.5, 0.5)
                m.ranges.uniform_(-1.0, 1.0)
    return model


def sources(lengths, vocab, seed):
    """Right-padded ``(B, S)`` sources of real tokens 3.. and their mask."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for b, n in enumerate(lengths):
        src[b, :n] = torch.randint(3, vocab, (n,), generator=g)
    return src, src != PAD


def full_log_probs(model, src, prefix):
    """``(len(prefix), V)`` next-token log-probs of a decoder input, by one full forward pass."""
    hidden = model(src[None], torch.tensor([EOS, *prefix])[None])  # (1, T, d)
    return torch.log_softmax(model.logits(hidden[0]).float(), -1)


def full_score(model, src, hyp, length_penalty):
    """Summed log-probs of ``hyp + </s>`` divided by its length ** length_penalty."""
    targets = torch.tensor([*hyp, EOS])
    lprobs = full_log_probs(model, src, hyp).gather(1, targets[:, None]).sum()
    return lprobs.item() / len(targets) ** length_penalty


def max_len(config, src_len, max_positions=16):
    return min(int(config.max_len_a * src_len + config.max_len_b), max_positions - 1)


def search_one(model, src, config, **ids):
    """Beam search on one unpadded sentence; returns (hypothesis as a list, score)."""
    hyps, scores = beam_search(model, src[None], None, config, **{**IDS, **ids})
    return hyps[0].tolist(), scores[0].item()


# ---------------------------------------------------------------------------------------------
# Constraints and edge cases


def biased(model, bias):
    """Add ``bias`` ``(V,)`` to the model's logits, to make some tokens overwhelmingly likely."""
    logits = model.logits
    model.logits = lambda hidden: logits(hidden) + bias
    return model


def test_max_length_is_respected_and_forced():
    model = toy_model(9, vocab=23, max_positions=8)
    bias = torch.zeros(23)
    bias[EOS] = -20.0  # </s> only where forced
    biased(model, bias)
    config = BeamSearchConfig(beam_size=3, max_len_a=1.0, max_len_b=1)
    lengths = [1, 3, 6]  # max lengths 2, 4 and 7 = max_positions - 1 (not 7)
    src, mask = sources(lengths, 23, seed=9)
    hyps, _ = beam_search(model, src, mask, config, **IDS)
    assert [len(h) for h in hyps] == [2, 4, 7]


@pytest.mark.parametrize("min_len, max_len_b, expected", [(3, 5, 3), (0, 5, 0), (4, 2, 2)])
def test_min_length_is_respected_unless_above_the_max(min_len, max_len_b, expected):
    model = toy_model(10, vocab=23)
    bias = torch.zeros(23)
    bias[EOS] = 20.0  # </s> as soon as allowed
    biased(model, bias)
    config = BeamSearchConfig(beam_size=2, max_len_a=0.0, max_len_b=max_len_b, min_len=min_len)
    src, mask = sources([4, 2], 23, seed=10)
    hyps, _ = beam_search(model, src, mask, config, **IDS)
    assert [len(h) for h in hyps] == [expected, expected]


def test_pad_and_banned_ids_never_appear():
    model = toy_model(11, vocab=23)
    bias = torch.zeros(23)
    bias[[BOS, PAD, 7, 8]] = 20.0  # the banned tokens would win everywhere
    biased(model, bias)
    src, mask = sources([5, 3], 23, seed=11)
    hyps, scores = beam_search(model, src, mask, BeamSearchConfig(beam_size=3), **{**IDS, "banned_ids": (BOS, 7, 8)})
    tokens = torch.cat(hyps)
    assert len(tokens) and not torch.isin(tokens, torch.tensor([BOS, PAD, EOS, 7, 8])).any()
    assert torch.isfinite(scores).all()


def test_dead_beams_never_feed_padding():
    model = toy_model(12)
    fed = []
    decode = model.decode
    model.decode = lambda tgt_in, *args: fed.append(tgt_in) or decode(tgt_in, *args)
    config = BeamSearchConfig(beam_size=20, max_len_a=0.0, max_len_b=3)  # more beams than live hypotheses
    src, mask = sources([3, 2], 6, seed=12)
    beam_search(model, src, mask, config, **IDS)
    assert fed and all(PAD not in t for t in fed)


def test_empty_batch():
    model = toy_model(12)
    hyps, scores = beam_search(model, torch.zeros(0, 4, dtype=torch.long), None, BeamSearchConfig(), **IDS)
    assert hyps == [] and scores.shape == (0,) and scores.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"beam_size": 0}, "beam_size"),
        ({"max_len_a": -1.0}, "max_len_a"),
        ({"min_len": -1}, "min_len"),
        ({"length_penalty": math.nan}, "length_penalty"),
        ({"length_penalty": -math.inf}, "length_penalty"),
        ({"max_len_b": -1}, "max_len_b"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchConfig(**kwargs)


def test_defaults_are_fairseqs_iwslt14_evaluation():
    """fairseq's IWSLT14 example (``--eval-bleu-args '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}'``) with
    fairseq-generate's own ``--lenpen 1`` and ``--min-len 1``."""
    assert dataclasses.asdict(BeamSearchConfig()) == {
        "beam_size": 5,
        "max_len_a": 1.2,
        "max_len_b": 10,
        "length_penalty": 1.0,
        "min_len": 1,
    }


def test_zero_length_bounds_are_valid():
    """``max_len_a = max_len_b = 0`` and ``min_len = 0``: every hypothesis is ``</s>`` alone."""
    model = toy_model(17)
    config = BeamSearchConfig(beam_size=2, max_len_a=0.0, max_len_b=0, min_len=0)
    src, mask = sources([3, 1], 6, seed=17)
    hyps, scores = beam_search(model, src, mask, config, **IDS)
    assert [h.tolist() for h in hyps] == [[], []]
    for row, score in zip(src, scores):
        assert score.item() == pytest.approx(full_score(model, row[row != PAD], [], 1.0), abs=1e-5)


def test_a_config_changed_after_construction_is_checked_again():
    config = BeamSearchConfig()
    config.beam_size = 0
    with pytest.raises(ValueError, match="beam_size must be >= 1, got 0"):
        beam_search(toy_model(13), torch.full((2, 3), 4), None, config, **IDS)


@pytest.mark.parametrize(
    "src, mask, ids, match",
    [
        (torch.full((3,), 4), None, {}, "src must be (B, S), got shape (3,)"),
        (torch.full((2, 0), 4), None, {}, "src has no source positions (S == 0)"),
        (
            torch.full((2, 3), 4),
            torch.ones(2, 3, dtype=torch.long),
            {},
            "src_mask must be a bool tensor of src's shape (2, 3), got torch.int64 (2, 3)",
        ),
        (
            torch.full((2, 3), 4),
            torch.ones(2, 4, dtype=torch.bool),
            {},
            "src_mask must be a bool tensor of src's shape (2, 3), got torch.bool (2, 4)",
        ),
        (torch.full((2, 3), 4), None, {"start_id": 7}, "start_id 7 is outside the vocabulary of 6 tokens"),
        (torch.full((2, 3), 4), None, {"eos_id": 6}, "eos_id 6 is outside the vocabulary of 6 tokens"),
        (torch.full((2, 3), 4), None, {"pad_id": -1}, "pad_id -1 is outside the vocabulary of 6 tokens"),
        (torch.full((2, 3), 4), None, {"banned_ids": (0, 9)}, "banned_ids 9 is outside the vocabulary of 6 tokens"),
        (torch.full((2, 3), 4), None, {"banned_ids": (EOS,)}, "eos_id 2 must be neither pad_id nor banned"),
        (torch.full((2, 3), 4), None, {"pad_id": EOS}, "eos_id 2 must be neither pad_id nor banned"),
        (
            torch.full((2, 3), 4),
            None,
            {"banned_ids": (0, 3, 4, 5)},
            "pad_id, eos_id and banned_ids leave no token to generate",
        ),
    ],
)
def test_argument_validation(src, mask, ids, match):
    """Each bad argument stops the search with its own message (matched whole)."""
    model = toy_model(13)
    with pytest.raises(ValueError, match=f"^{re.escape(match)}$"):
        beam_search(model, src, mask, BeamSearchConfig(), **{**IDS, **ids})


def test_an_empty_batch_may_have_no_source_positions():
    hyps, scores = beam_search(toy_model(13), torch.zeros(0, 0, dtype=torch.long), None, BeamSearchConfig(), **IDS)
    assert hyps == [] and scores.shape == (0,)


# ---------------------------------------------------------------------------------------------
# Exact semantics: ties, precision, devices


def constant_logits(model, logits):
    """Make the model's next-token logits ``logits`` ``(V,)`` (in their own dtype) whatever the prefix."""
    model.logits = lambda hidden: logits.expand(*hidden.shape[:-1], -1)
    return model


def test_a_tie_keeps_the_hypothesis_finalised_first():
    """fairseq sorts finalised hypotheses stably by score: of two with the same score, the earlier wins.
    </s> and token 3 share the top logit everywhere, so ``[] </s>`` (score v) and ``[3] </s>`` (2v / 2 = v,
    exactly in binary floating point) tie."""
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0, -1.0])  # <s> and <pad> are banned
    model = constant_logits(toy_model(15), logits)
    config = BeamSearchConfig(beam_size=2, max_len_a=0.0, max_len_b=3, length_penalty=1.0, min_len=0)
    src, mask = sources([3], 6, seed=15)
    hyps, scores = beam_search(model, src, mask, config, **IDS)
    v = torch.log_softmax(logits.float(), -1)[EOS]
    assert hyps[0].tolist() == [] and scores[0] == v
    assert reference_beam_search(model, src[0], config) == ([], pytest.approx(v.item(), abs=1e-6))


def test_bf16_logits_are_normalised_in_fp32():
    """The log-probs of a bf16 model's logits are taken in fp32: the score is that of float64 arithmetic on
    the same bf16 logits, to fp32 precision (bf16 arithmetic would be off by about 1e-2)."""
    logits = torch.tensor([0.0, 0.0, 1.3, 0.7, 2.9, -0.4], dtype=torch.bfloat16)
    model = constant_logits(toy_model(16), logits)
    config = BeamSearchConfig(beam_size=1, max_len_a=0.0, max_len_b=2, length_penalty=0.0, min_len=0)
    src, mask = sources([2], 6, seed=16)
    hyps, scores = beam_search(model, src, mask, config, **IDS)
    lprobs = torch.log_softmax(logits.double(), -1)
    assert hyps[0].tolist() == [4, 4]  # the most likely token up to the maximum length, then </s>
    assert scores[0].item() == pytest.approx((2 * lprobs[4] + lprobs[EOS]).item(), abs=1e-5)


def test_every_tensor_is_made_on_the_inputs_device():
    """On a GPU, a tensor made without ``device=`` lands on the CPU. Here the default device is ``meta``
    while model and inputs are on the CPU: a tensor made on the default device would fail the search."""
    model = toy_model(8, vocab=23, logit_std=0.2, max_positions=32)
    config = BeamSearchConfig(beam_size=4, max_len_a=1.2, max_len_b=2, length_penalty=1.0)
    src, mask = sources([6, 1, 9, 4, 2], 23, seed=8)
    hyps, scores = beam_search(model, src, mask, config, **IDS)
    with torch.device("meta"):
        hyps_meta, scores_meta = beam_search(model, src, mask, config, **IDS)
    assert [h.tolist() for h in hyps_meta] == [h.tolist() for h in hyps]
    assert scores_meta.device.type == "cpu" and torch.equal(scores_meta, scores)


# ---------------------------------------------------------------------------------------------
# Against independent references


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_finds_the_exhaustive_optimum(seed, length_penalty):
    model = toy_model(seed)
    words = (3, 4, 5)  # every token but <s> (banned), <pad> and </s>
    config = BeamSearchConfig(
        beam_size=36, max_len_a=0.5, max_len_b=2, length_penalty=length_penalty, min_len=seed % 2
    )  # max length int(0.5 * 2 + 2) = int(0.5 * 3 + 2) = 3
    # 36 beams hold every live candidate: 3 ** 2 live hypotheses x 4 continuations at the last free step
    src, _ = sources([2 + seed % 2], 6, seed)
    candidates = [h for n in range(config.min_len, 4) for h in itertools.product(words, repeat=n)]
    scores = {h: full_score(model, src[0], h, length_penalty) for h in candidates}
    best = max(scores, key=scores.get)

    hyp, score = search_one(model, src[0], config)
    assert hyp == list(best)
    assert score == pytest.approx(scores[best], abs=1e-5)


def greedy(model, src, config):
    """Greedy decoding with full recomputation at every step."""
    limit, hyp, total = max_len(config, len(src)), [], 0.0
    while True:
        lprobs = full_log_probs(model, src, hyp)[-1]  # (V,)
        allowed = torch.ones_like(lprobs, dtype=torch.bool)
        allowed[[PAD, BOS]] = False
        if len(hyp) < config.min_len:
            allowed[EOS] = False
        if len(hyp) == limit:
            allowed[:] = False
            allowed[EOS] = True
        token = int(lprobs.masked_fill(~allowed, -math.inf).argmax())
        total += lprobs[token].item()
        if token == EOS:
            return hyp, total / (len(hyp) + 1) ** config.length_penalty
        hyp.append(token)


def assert_search_matches(reference, model, src, config):
    """``search_one`` gives ``reference``'s hypothesis and score for every (unpadded) row of ``src``."""
    for row in src:
        row = row[row != PAD]
        hyp, score = search_one(model, row, config)
        ref_hyp, ref_score = reference(model, row, config)
        assert hyp == ref_hyp
        assert score == pytest.approx(ref_score, abs=1e-5)


@pytest.mark.parametrize("attention", ["softmax", "multimax"])
def test_beam_one_is_greedy(attention):
    model = toy_model(3, vocab=23, attention=attention, logit_std=0.15)
    config = BeamSearchConfig(beam_size=1, max_len_a=1.0, max_len_b=3, min_len=2)
    src, _ = sources([4, 6, 2], 23, seed=3)
    assert_search_matches(greedy, model, src, config)


def reference_beam_search(model, src, config):
    """fairseq's beam search for one sentence, plainly: full recomputation, Python lists."""
    K, limit = config.beam_size, max_len(config, len(src))
    beams, finalised = [([], 0.0)], []  # (tokens, summed log-probs); step 0 expands one beam
    for step in range(limit + 1):
        candidates = []
        for hyp, score in beams:
            lprobs = full_log_probs(model, src, hyp)[-1].tolist()
            for token, lp in enumerate(lprobs):
                forbidden = token in (PAD, BOS) or (token == EOS and step < config.min_len)
                if (token == EOS) if step == limit else not forbidden:
                    candidates.append((score + lp, hyp, token))
        candidates = sorted(candidates, key=lambda c: -c[0])[: 2 * K]
        for score, hyp, token in candidates[:K]:
            if token == EOS:
                finalised.append((score / (step + 1) ** config.length_penalty, hyp))
        if len(finalised) >= K:
            break
        beams = [(hyp + [token], score) for score, hyp, token in candidates if token != EOS][:K]
    score, hyp = max(finalised, key=lambda f: f[0])
    return hyp, score


# seeds 8, 9, 11: a sentence stops with 3 finalised hypotheses while a live beam would end better
@pytest.mark.parametrize("seed, length_penalty", [(4, 1.0), (5, 0.0), (8, 2.0), (9, 1.0), (11, 2.0)])
def test_equals_plain_fairseq_beam_search(seed, length_penalty):
    model = toy_model(seed, vocab=9, logit_std=0.3)
    config = BeamSearchConfig(beam_size=3, max_len_a=0.5, max_len_b=3, length_penalty=length_penalty)
    src, _ = sources([3, 5], 9, seed)
    assert_search_matches(reference_beam_search, model, src, config)


def test_score_is_the_full_recompute_score_of_the_hypothesis():
    model = toy_model(7, vocab=23, logit_std=0.2)
    config = BeamSearchConfig(beam_size=5, length_penalty=1.0)
    src, mask = sources([5, 3, 7], 23, seed=7)
    hyps, scores = beam_search(model, src, mask, config, **IDS)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    for row, hyp, score in zip(src, hyps, scores):
        row = row[row != PAD]
        assert hyp.dtype == torch.int64 and hyp.dim() == 1
        assert score.item() == pytest.approx(full_score(model, row, hyp.tolist(), 1.0), abs=1e-5)


def test_wide_beam_keeps_the_best_live_candidates():
    """Ten beams, with </s> likely enough to rank among the best continuations of most beams: each step
    must carry on the ten best candidates not ending in </s>, in score order (the fairseq reference)."""
    model = toy_model(14, vocab=23, logit_std=0.3)
    bias = torch.zeros(23)
    bias[EOS] = 2.0
    biased(model, bias)
    config = BeamSearchConfig(beam_size=10, max_len_a=0.0, max_len_b=4, length_penalty=2.0, min_len=0)
    src, _ = sources([3, 5, 4], 23, seed=14)
    assert_search_matches(reference_beam_search, model, src, config)


@pytest.mark.parametrize("attention", ["softmax", "multimax"])
def test_batch_equals_one_by_one(attention):
    model = toy_model(8, vocab=23, attention=attention, logit_std=0.2, max_positions=32)
    config = BeamSearchConfig(beam_size=4, max_len_a=1.2, max_len_b=2, length_penalty=1.0)
    lengths = [6, 1, 9, 4, 2]  # different max lengths: sentences finish and leave the batch at different steps
    src, mask = sources(lengths, 23, seed=8)
    hyps, scores = beam_search(model, src, mask, config, **IDS)
    for b, n in enumerate(lengths):
        hyp, score = search_one(model, src[b, :n], config)
        assert hyps[b].tolist() == hyp
        assert scores[b].item() == pytest.approx(score, abs=1e-5)
