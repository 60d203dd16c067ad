"""Training streams: order fixed by (seed, epoch, rank), independent of loader workers, resumable
at any batch from the state Lightning saves; header-only skipping; the shared epoch length."""

import io
import random
import re
import tarfile
import warnings
from itertools import islice
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds
from torch.utils.data import get_worker_info

from mmlight.data import ImageShardDataModule, RecallDataModule, WikiTextDataModule
from mmlight.data.image_decode import AugmentGroup
from mmlight.data.on_device import ErasingBoxes
from mmlight.data.shards import MemberReader, npy_header, tar_index
from mmlight.data.skips import SkipCounter
from mmlight.data.streaming import (
    PURPOSES,
    RankRandom,
    ResumableLoader,
    ShardDataModule,
    StreamDataset,
    StreamSource,
    resampled_samples,
    run_seed,
    shuffled,
)
from tests.helpers.images import DEIT_LIKE, write_image_shards


def test_epoch_steps_divides_by_the_ranks_and_refuses_less_than_one_batch():
    data = ShardDataModule("unused", num_workers=0, val_split="val", test_split="test")
    assert data.epoch_steps(100, 8, "8 samples") == 12  # one process: 100 // 8
    data.trainer = SimpleNamespace(global_rank=1, world_size=4)
    assert data._rank_and_world() == (1, 4)
    assert data.epoch_steps(100, 8, "8 samples") == 3  # 100 // (8 x 4)
    with pytest.raises(ValueError, match=r"\(100\) is smaller than one global batch \(32 samples x 4 devices\)"):
        data.epoch_steps(100, 32, "32 samples")


# ---------------------------------------------------------------- header-only reading


def test_tar_index_matches_tarfile_and_npy_header_matches_numpy(tmp_path):
    """Offsets and sizes from the headers alone agree with Python's tarfile (long names and pax
    headers included), and an .npy member's header gives numpy's dtype, shape and data bytes."""
    arrays = {
        f"{'long' * 40}/k{i}.ids.npy": np.arange(i * 7, dtype=np.uint32 if i % 2 else np.int64) for i in range(1, 4)
    }
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, array in arrays.items():
            buf = io.BytesIO()
            np.save(buf, array)
            info = tarfile.TarInfo(name)
            info.size = len(buf.getvalue())
            info.pax_headers = {"comment": "x"}
            tar.addfile(info, io.BytesIO(buf.getvalue()))
    with tarfile.open(path) as tar:
        expected = [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
    assert list(tar_index(path)) == expected
    reader = MemberReader()
    for name, offset, size in expected:
        dtype, shape, data = npy_header(reader, str(path), offset, size)
        array = arrays[name]
        assert (dtype, shape) == (array.dtype, array.shape)
        raw = reader.read(str(path), data, array.nbytes)
        np.testing.assert_array_equal(np.frombuffer(raw, dtype), array)


def test_truncated_shard_is_an_error_from_headers_alone(tmp_path):
    path = tmp_path / "t.tar"
    with wds.TarWriter(str(path)) as writer:
        writer.write({"__key__": "a", "bin": b"x" * 3000})
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(EOFError, match="truncated member"):
        list(tar_index(path))


def test_shuffle_buffer_permutes_and_depends_only_on_its_generator():
    items = list(range(50))
    out = list(shuffled(items, 8, random.Random(3)))
    assert sorted(out) == items and out != items
    assert out == list(shuffled(items, 8, random.Random(3)))
    assert out != list(shuffled(items, 8, random.Random(4)))
    rng = random.Random(3)
    assert list(shuffled(items, 1, rng)) == items
    assert rng.getstate() == random.Random(3).getstate()  # keeping the order draws nothing


@pytest.mark.parametrize("buffer", [2, 4])
def test_shuffle_buffer_holds_exactly_buffer_items(buffer):
    """Output position p is drawn once input item p + buffer - 1 has been read, so an item leaves at most
    buffer - 1 places before its input position; over many seeds that bound is reached, never passed."""
    items = list(range(40))
    advances = set()
    for seed in range(30):
        out = list(shuffled(items, buffer, random.Random(seed)))
        assert sorted(out) == items
        advances |= {item - position for position, item in enumerate(out)}
    assert max(advances) == buffer - 1


def test_rank_random_seeds_each_stream_from_seed_epoch_rank_and_purpose():
    """Python's generator is seeded with the 128-bit number of SeedSequence([seed, epoch, rank, purpose])'s
    first two 64-bit words, NumPy's with that entropy itself; shared streams leave the rank out. (The
    derivation is part of every run's data order: changing it reorders runs resumed from old checkpoints.)"""
    rand = RankRandom(7, 2, 3)
    high, low = np.random.SeedSequence([7, 2, 3, PURPOSES["shards"]]).generate_state(2, np.uint64)
    want = random.Random(int(high) * 2**64 + int(low))
    draws = rand.python("shards")
    assert [draws.random() for _ in range(3)] == [want.random() for _ in range(3)]
    assert rand.python("shards").random() != RankRandom(7, 2, 0).python("shards").random()  # per rank by default
    shared = RankRandom(7, 2, 0).python("shuffle", per_rank=False).random()
    assert rand.python("shuffle", per_rank=False).random() == shared
    want = np.random.default_rng([7, 2, 3, PURPOSES["offsets"]]).integers(1 << 30, size=5)
    np.testing.assert_array_equal(rand.numpy("offsets").integers(1 << 30, size=5), want)
    shared = np.random.default_rng([7, 2, PURPOSES["order"]]).permutation(20)
    np.testing.assert_array_equal(rand.numpy("order", per_rank=False).permutation(20), shared)
    np.testing.assert_array_equal(RankRandom(7, 2, 0).numpy("order", per_rank=False).permutation(20), shared)
    assert rand.entropy("unit", 4) == [7, 2, 3, PURPOSES["unit"], 4]  # a unit's generators: per rank
    assert rand.entropy("unit", 4, per_rank=False) == [7, 2, PURPOSES["unit"], 4]


def test_run_seed_is_seed_everythings_or_0(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert run_seed() == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "17")
    assert run_seed() == 17


class DrawSource(StreamSource):
    """Units are draws of the rank's ``order`` stream, materialised as they are; records ``count_skips``."""

    def __init__(self):
        self.asked = []

    def units(self, rand, count_skips):
        self.asked.append(count_skips)
        draws = rand.python("order")
        while True:
            yield draws.randrange(10**9)

    def materialise(self, unit):
        return unit


def test_a_new_stream_dataset_gives_epoch_0_from_its_first_batch():
    source = DrawSource()
    got = list(StreamDataset(source, steps=4, seed=3, rank=1))
    draws = RankRandom(3, 0, 1).python("order")
    assert got == [draws.randrange(10**9) for _ in range(4)]
    assert source.asked == [True]  # the only process is the one that reports unreadable shards


@pytest.mark.parametrize("worker, reports", [(0, True), (1, False)])
def test_only_loader_worker_0_reports_unreadable_shards(monkeypatch, worker, reports):
    """Every worker reads the same shard headers: if all reported, one bad shard would be counted once
    per worker. Worker ``w`` of 2 is simulated in-process; it still makes only its own batches."""
    import mmlight.data.streaming as streaming

    monkeypatch.setattr(streaming, "get_worker_info", lambda: SimpleNamespace(id=worker, num_workers=2))
    source = DrawSource()
    got = list(StreamDataset(source, steps=4, seed=3, rank=0))
    draws = RankRandom(3, 0, 0).python("order")
    assert got == [draws.randrange(10**9) for _ in range(4)][worker::2]
    assert source.asked == [reports]


def test_seeded_rngs_seed_all_three_generators_from_both_words_and_restore_them():
    """Inside the block, Python's generator is seeded with the 64-bit number made of both 32-bit words
    of the entropy's SeedSequence, NumPy's with the first word and torch's with the 64-bit number;
    after it, each generator continues where it was."""
    from mmlight.data.streaming import seeded_rngs

    words = [int(w) for w in np.random.SeedSequence([5, 1, 0, 4, 9]).generate_state(2, np.uint32)]
    full = words[0] * 2**32 + words[1]
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    before = random.Random(123).random(), np.random.RandomState(123).random_sample()  # the next draws outside
    with seeded_rngs([5, 1, 0, 4, 9]):
        inside = random.random(), float(np.random.random()), torch.rand(()).item()
    assert inside[0] == random.Random(full).random()
    assert inside[1] == np.random.RandomState(words[0]).random_sample()
    assert inside[2] == torch.rand((), generator=torch.Generator().manual_seed(full)).item()
    assert random.random() == before[0] and float(np.random.random()) == before[1]
    assert torch.rand(()).item() == torch.rand((), generator=torch.Generator().manual_seed(123)).item()


class WorkerDrawSource(DrawSource):
    """Materialises a unit as (unit, the loader worker that made it, a draw of each seeded global generator)."""

    def materialise(self, unit):
        info = get_worker_info()
        return (
            unit,
            None if info is None else info.id,
            random.random(),
            float(np.random.random()),
            torch.rand(()).item(),
        )


def test_worker_w_of_3_makes_batches_start_plus_w_and_each_unit_has_its_own_seed():
    """Resumed at batch 1 with 3 loader workers: batches 1..6 of the single-process run (units and
    augmentation draws), made by workers 0, 1, 2, 0, 1, 2; each unit's draws differ (seeded by its index)."""

    def resumed(workers):
        loader = ResumableLoader(StreamDataset(WorkerDrawSource(), steps=7, seed=3, rank=0), workers, world_size=1)
        loader.load_state_dict({**loader.state_dict(), "position": 1})
        loader.set_epoch(0)
        return list(loader)

    alone, got = resumed(0), resumed(3)
    draws = RankRandom(3, 0, 0).python("order")
    assert [unit for unit, *_ in got] == [draws.randrange(10**9) for _ in range(7)][1:]
    assert [worker for _, worker, *_ in got] == [0, 1, 2, 0, 1, 2] and [w for _, w, *_ in alone] == [None] * 6
    assert [(unit, *rest) for unit, _, *rest in got] == [(unit, *rest) for unit, _, *rest in alone]
    for generator in (2, 3, 4):  # Python's, NumPy's, torch's
        assert len({batch[generator] for batch in got}) == 6


class DrawLimit(random.Random):
    """A ``random.Random`` that fails the test after ``limit`` draws (instead of a stream spinning forever)."""

    def __init__(self, seed: int, limit: int):
        super().__init__(seed)
        self.draws, self.limit = 0, limit

    def randrange(self, *args):
        self.draws += 1
        assert self.draws <= self.limit, "the stream kept drawing shards"
        return super().randrange(*args)


def test_resampled_samples_count_each_unreadable_draw_and_go_on(tmp_path, caplog):
    good = tmp_path / "good.tar"
    with wds.TarWriter(str(good)) as writer:
        writer.write({"__key__": "only", "txt": b"1"})  # one sample per good draw
    urls = [str(tmp_path / "missing-a.tar"), str(good), str(tmp_path / "missing-b.tar")]
    replay = random.Random(5)  # the draws the stream makes, replayed by hand
    failed_draws = good_draws = 0
    while good_draws < 12:
        if urls[replay.randrange(3)] == str(good):
            good_draws += 1
        else:
            failed_draws += 1
    counter = SkipCounter()
    with caplog.at_level("WARNING", logger="mmlight.data.streaming"):
        samples = list(islice(resampled_samples(urls, random.Random(5), counter), 12))
    assert [s["__key__"] for s in samples] == ["only"] * 12 and failed_draws > 0
    assert counter.value == failed_draws == len(caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmlight.data.streaming"):
        assert len(list(islice(resampled_samples(urls, random.Random(5), None), 12))) == 12
    assert caplog.records == []  # None: a worker that neither counts nor logs


def test_no_readable_shard_stops_the_stream_naming_them(tmp_path):
    urls = [str(tmp_path / f"missing-{i}.tar") for i in range(5)]
    named = ", ".join(repr(u) for u in sorted(urls)[:3])
    with pytest.raises(
        RuntimeError, match=re.escape(f"no readable sample in any of the 5 training shards, e.g. [{named}]")
    ):
        next(resampled_samples(urls + urls[:2], DrawLimit(0, 500), None))  # a repeated shard is one shard


def test_loader_state_names_its_layout_and_a_new_worker_count_is_logged(image_shards, monkeypatch, caplog):
    loader = image_loader(image_shards, 0, monkeypatch)
    assert loader.state_dict() == {"epoch": 0, "position": 0, "seed": 0, "world_size": 1, "steps": 10, "num_workers": 0}
    with caplog.at_level("INFO", logger="mmlight.data.streaming"):
        loader.load_state_dict(loader.state_dict())
        assert caplog.records == []
        loader.load_state_dict({**loader.state_dict(), "num_workers": 3})
    assert [r.getMessage() for r in caplog.records] == [
        "resuming with 0 loader workers (checkpoint: 3): the order does not depend on them"
    ]


# ---------------------------------------------------------------- whole streams


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory):
    return write_image_shards(tmp_path_factory.mktemp("images"))


def image_loader(root, seed, monkeypatch, num_workers=0, world=(0, 1)):
    monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
    data = ImageShardDataModule(
        str(root), batch_size=4, num_workers=num_workers, augment=DEIT_LIKE, shuffle_buffer=10, repeated_augmentation=2
    )
    data.trainer = SimpleNamespace(global_rank=world[0], world_size=world[1])
    return data.train_dataloader()


def recall_loader(seed, monkeypatch, num_workers=0):
    monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
    data = RecallDataModule(train_size=200, val_size=8, test_size=8, batch_size=16, num_workers=num_workers)
    return data.train_dataloader()


@pytest.fixture(scope="module")
def wikitext_shards(tmp_path_factory):
    from tests.helpers.text_fixtures import write_text_shard_sets

    return write_text_shard_sets(tmp_path_factory.mktemp("text"))


def wikitext_loader(shards, seed, monkeypatch, num_workers=0):
    monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
    return WikiTextDataModule(
        str(shards["wikitext103"]), block_size=4, batch_size=2, num_workers=num_workers, shuffle_buffer=16
    ).train_dataloader()


def translation_loader(shards, seed, monkeypatch, num_workers=0):
    from mmlight.data import TranslationDataModule

    monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
    return TranslationDataModule(
        str(shards["iwslt14"]), max_tokens=64, num_workers=num_workers, bucket_buffer=6
    ).train_dataloader()


def flat(batch) -> list[torch.Tensor]:
    """The tensors of a batch (tuple or dict), in a fixed order; random-erasing boxes and their fill
    seed (uint8 image batches) included."""
    items = batch.values() if isinstance(batch, dict) else batch
    tensors = []
    for item in items:
        if isinstance(item, ErasingBoxes):
            tensors += [item.boxes, torch.tensor(item.seed)]
        elif isinstance(item, torch.Tensor):
            tensors.append(item)
    return tensors


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(flat(x)) == len(flat(y)) and all(torch.equal(s, t) for s, t in zip(flat(x), flat(y))) for x, y in zip(a, b)
    )


def epochs(loader, n_epochs=2) -> list:
    out = []
    for epoch in range(n_epochs):
        loader.set_epoch(epoch)
        out += list(loader)
    return out


@pytest.fixture(params=["images", "recall", "wikitext", "translation"])
def make_loader(request, image_shards, wikitext_shards, monkeypatch):
    def make(seed, num_workers=0):
        if request.param == "images":
            return image_loader(image_shards, seed, monkeypatch, num_workers)
        if request.param == "recall":
            return recall_loader(seed, monkeypatch, num_workers)
        if request.param == "wikitext":
            return wikitext_loader(wikitext_shards, seed, monkeypatch, num_workers)
        return translation_loader(wikitext_shards, seed, monkeypatch, num_workers)

    return make


def test_same_seed_same_batches_other_seed_other_order(make_loader):
    """Two loaders with one seed give identical batches (augmentations included) over two epochs;
    another seed gives others; the second epoch differs from the first."""
    first = epochs(make_loader(0))
    assert len(first) == 2 * len(make_loader(0))
    assert same(first, epochs(make_loader(0)))
    assert not same(first, epochs(make_loader(1)))
    half = len(first) // 2
    assert not same(first[:half], first[half:])


def test_resume_from_state_continues_with_the_next_batch(make_loader):
    """A loader rebuilt from the state saved after k batches (mid-epoch, and at the epoch's end)
    yields exactly what the uninterrupted loader yields after batch k."""
    reference = epochs(make_loader(0))
    steps = len(reference) // 2
    for k in (1, steps - 1, steps):
        loader = make_loader(0)
        loader.set_epoch(0)
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()
        assert (state["epoch"], state["position"]) == (0, k)
        resumed = make_loader(0)
        resumed.load_state_dict(state)
        resumed.set_epoch(0 if k < steps else 1)  # what Lightning's fit loop does on restart
        rest = list(resumed)
        if k < steps:
            resumed.set_epoch(1)
            rest += list(resumed)
        assert same(rest, reference[k:])


def test_loader_workers_do_not_change_the_batches(image_shards, wikitext_shards, monkeypatch):
    """Two worker processes give the batches of one process, in the same order, also after a resume
    written with another worker count."""
    reference = epochs(image_loader(image_shards, 0, monkeypatch))
    assert same(epochs(image_loader(image_shards, 0, monkeypatch, num_workers=2)), reference)
    resumed = image_loader(image_shards, 0, monkeypatch, num_workers=2)
    resumed.load_state_dict({**image_loader(image_shards, 0, monkeypatch).state_dict(), "epoch": 1, "position": 3})
    resumed.set_epoch(1)
    assert same(list(resumed), reference[len(reference) // 2 + 3 :])
    tokens = wikitext_loader(wikitext_shards, 0, monkeypatch)
    assert same(epochs(wikitext_loader(wikitext_shards, 0, monkeypatch, num_workers=2)), epochs(tokens))


def test_ranks_get_different_streams(image_shards, monkeypatch):
    rank0 = epochs(image_loader(image_shards, 0, monkeypatch, world=(0, 2)), 1)
    rank1 = epochs(image_loader(image_shards, 0, monkeypatch, world=(1, 2)), 1)
    assert len(rank0) == len(rank1) == 40 // (4 * 2)
    assert not same(rank0, rank1)


def test_resuming_skips_without_decoding(image_shards, monkeypatch):
    """Reaching batch k decodes none of the k skipped batches: only the batch that is returned."""
    decoded = []
    original = AugmentGroup.__call__
    monkeypatch.setattr(AugmentGroup, "__call__", lambda self, sample: decoded.append(1) or original(self, sample))
    loader = image_loader(image_shards, 0, monkeypatch)
    loader.load_state_dict({**loader.state_dict(), "position": 4})
    next(iter(loader))
    assert len(decoded) == 2  # one batch of 4 rows: 2 images, decoded once for their 2 copies each


def test_corrupt_image_keeps_the_batch_size_and_is_counted(image_shards, monkeypatch, caplog):
    """Every decode of the corrupt image is counted once and logged with its key (not >= 1: exactly the
    decodes that were tried, seen where the decode is called)."""
    tried = []
    original = AugmentGroup.__call__
    monkeypatch.setattr(
        AugmentGroup, "__call__", lambda self, sample: tried.append(sample["__key__"]) or original(self, sample)
    )
    loader = image_loader(image_shards, 0, monkeypatch)
    with caplog.at_level("WARNING"):
        batches = epochs(loader, 3)
    assert all(images.shape == (4, 16, 16, 3) and labels.shape == (4,) for images, labels, _ in batches)
    corrupt = [key for key in tried if key.endswith("img0005")]
    skips = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped corrupt sample")]
    assert len(corrupt) >= 1 and loader.dataset.source.counter.value == len(corrupt) == len(skips)
    assert all("img0005" in message for message in skips)


def test_changed_layout_warns_naming_both(image_shards, monkeypatch):
    state = image_loader(image_shards, 0, monkeypatch, world=(0, 1)).state_dict()
    loader = image_loader(image_shards, 0, monkeypatch, world=(0, 2))
    with pytest.warns(
        UserWarning,
        match=r"written with seed 0, 1 rank\(s\) and 10 batches per epoch under "
        r"seed 0, 2 rank\(s\) and 5 batches per epoch.*order from this point",
    ):
        loader.load_state_dict({**state, "position": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: loading the same state again (DataPosition) is silent
        loader.load_state_dict({**state, "position": 3})
    loader.set_epoch(0)
    assert len(list(loader)) == 5 - 3


def test_lightning_sees_a_stateful_loader():
    """Lightning's CombinedLoader saves the state of loaders that have state_dict/load_state_dict."""
    from lightning.fabric.utilities.types import _Stateful

    assert isinstance(ResumableLoader.__new__(ResumableLoader), _Stateful)
