"""AttentionStats: what it logs equals collect_statistics on the first validation samples; off, nothing
is observed; under 2-process DDP it runs on rank 0 only and nothing hangs."""

import csv
import importlib
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from mmlight.analysis.massive import MassiveSettings, massive_activations
from mmlight.analysis.stats import collect_statistics
from mmlight.callbacks import AttentionStats
from mmlight.data import RecallDataModule
from mmlight.tasks import LanguageModel
from tests.helpers.cli import run_mmlight
from tests.helpers.models import tiny_transformer
from tests.helpers.trainer import quiet_trainer

ROOT = Path(__file__).resolve().parents[2]
LM = ROOT / "configs" / "quickstart" / "lm_softmax.yaml"
attention_module = importlib.import_module("mmlight.nn.attention")


class ObservationProbe(L.Callback):
    """Notes whether any observer was active during a validation step (it must not be)."""

    def __init__(self):
        self.observed = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.observed.append(attention_module._OBSERVED.get() is not None)


def fit_recall_lm(logger, callbacks, epochs: int, sanity_steps: int):
    """A seeded two-layer LM trained on a tiny recall task; returns the task and its data.

    Args:
        logger: the trainer's logger.
        callbacks: the trainer's callbacks.
        epochs: training epochs.
        sanity_steps: validation batches of Lightning's sanity check before training.
    """
    torch.manual_seed(0)
    data = RecallDataModule(
        num_keys=8, num_values=8, num_pairs=3, num_queries=3, train_size=64, val_size=24, batch_size=8
    )
    task = LanguageModel(
        tiny_transformer(),
        warmup_steps=2,
    )
    trainer = quiet_trainer(max_epochs=epochs, logger=logger, callbacks=callbacks, num_sanity_val_steps=sanity_steps)
    trainer.fit(task, datamodule=data)
    return task, data


def tiny_run(tmp_path, callbacks, epochs=2):
    """``fit_recall_lm`` with a CSV logger under ``tmp_path`` and one sanity batch; returns the task, the data
    and the logged metrics.csv."""
    logger = CSVLogger(tmp_path, name="run")
    task, data = fit_recall_lm(logger, callbacks, epochs, sanity_steps=1)
    logger.save()
    return task, data, Path(logger.log_dir) / "metrics.csv"


def test_logged_values_equal_statistics_of_the_first_samples(tmp_path):
    probe = ObservationProbe()
    stats_cb = AttentionStats(every_n_epochs=1, num_samples=10, figures="off")
    task, data, metrics = tiny_run(tmp_path, [stats_cb, probe])

    rows = list(csv.DictReader(open(metrics)))
    logged = [r for r in rows if r.get("attention/decoder.layers.1.self_attn/entropy")]
    assert len(logged) == 2  # epochs 0 and 1, not the sanity check
    # the same 10 samples every time: the first of the validation split
    data.setup("validate")
    expected = torch.cat([b["input"] for b in data.val_dataloader()])[:10]
    assert torch.equal(torch.cat([b["input"] for b in stats_cb.batches]), expected)
    want = collect_statistics(task, [{"input": expected}])  # after training = the last recording
    last = logged[-1]
    value = float(last["attention/decoder.layers.1.self_attn/entropy"])
    assert value == pytest.approx(want["sites"]["decoder.layers.1.self_attn"]["metrics"]["entropy"], rel=1e-6)
    assert float(last["attention/decoder.layers.0/token_similarity"]) == pytest.approx(
        want["blocks"]["decoder.layers.0"]["token_similarity"], rel=1e-6
    )
    assert not any(probe.observed)  # validation itself never runs observed (fused paths stay fused)


def test_every_k_epochs_and_off_records_nothing(tmp_path):
    _, _, metrics = tiny_run(tmp_path / "k", [AttentionStats(every_n_epochs=2, num_samples=4, figures="off")], epochs=3)
    rows = list(csv.DictReader(open(metrics)))
    assert len([r for r in rows if r.get("attention/seconds")]) == 2  # validation epochs 0 and 2
    assert len([r for r in rows if r.get("attention/validation_seconds")]) == 3  # its cost reference, every epoch
    probe = ObservationProbe()
    _, _, metrics = tiny_run(tmp_path / "off", [probe], epochs=1)
    assert "attention/seconds" not in open(metrics).readline()
    assert probe.observed and not any(probe.observed)


def test_figures_drawn_off_the_loop_are_logged_at_their_recording_step(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    massive_labels = []  # the massive figure is drawn under the label of its recording's epoch
    draw = attention_stats_module.draw_massive
    monkeypatch.setattr(
        attention_stats_module,
        "draw_massive",
        lambda result, label: massive_labels.append(label) or draw(result, label),
    )
    # figures: every recording (the default); the massive-activations figure drawn beside them
    stats_cb = AttentionStats(every_n_epochs=1, num_samples=6, massive_activations=True)
    fit_recall_lm(TensorBoardLogger(tmp_path, name="run"), [stats_cb], epochs=3, sanity_steps=0)
    assert stats_cb._worker is None and not stats_cb._pending  # drained and shut down at teardown

    acc = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    recorded = [e.step for e in acc.Scalars("attention/seconds")]
    assert recorded == [8, 16, 24]  # 8 training batches per epoch
    for tag in ("attention/weight_histogram", "attention/weight_cdf", "attention/token_similarity"):
        images = acc.Images(tag)
        assert [e.step for e in images] == recorded
        assert all(e.width > 100 and e.height > 100 for e in images)
    assert [e.step for e in acc.Scalars("attention/figure_seconds")] == recorded
    assert [e.step for e in acc.Scalars("attention/reduce_seconds")] == recorded
    assert len(acc.Scalars("attention/final_wait_seconds")) == 1
    assert [e.step for e in acc.Images("massive/activations")] == recorded
    assert [e.step for e in acc.Scalars("massive/figure_seconds")] == recorded
    assert massive_labels == ["epoch 0", "epoch 1", "epoch 2"]
    # the similarity figure of the last recording draws one line per recorded epoch
    assert list(stats_cb.similarity_history) == ["epoch 0", "epoch 1", "epoch 2"]


def test_drawn_figures_are_images_of_the_recorded_statistics():
    from mmlight.callbacks.attention_stats import draw_figures

    torch.manual_seed(0)
    task = LanguageModel(tiny_transformer())
    stats = collect_statistics(task, [{"input": torch.randint(0, 20, (4, 12))}])
    images, seconds = draw_figures(stats, {"epoch 0": {"blocks": stats["blocks"]}})
    assert set(images) == {"attention/weight_histogram", "attention/weight_cdf", "attention/token_similarity"}
    for image in images.values():
        assert image.dtype.name == "uint8" and image.ndim == 3 and image.shape[2] == 3
        assert image.min() < 128 < image.max()  # lines drawn on a white background, not a blank canvas
    assert seconds > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="every_n_epochs"):
        AttentionStats(every_n_epochs=0)
    with pytest.raises(ValueError, match="figures must be"):
        AttentionStats(figures="sometimes")
    with pytest.raises(ValueError, match="keep_mib must be >= 0, got -1"):
        AttentionStats(keep_mib=-1)


@pytest.mark.slow
def test_two_process_ddp_does_not_hang_and_only_rank_0_records(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    args = [
        "fit",
        "--config",
        str(LM),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_epochs",
        "2",
        "--data.init_args.train_size",
        "256",
        "--data.init_args.val_size",
        "64",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        "--trainer.callbacks+=mmlight.callbacks.AttentionStats",
        "--trainer.callbacks.every_n_epochs",
        "1",
        "--trainer.callbacks.num_samples",
        "8",
    ]
    result = run_mmlight(*args, cwd=tmp_path, env=env, timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "runs").rglob("events.out.tfevents*"))
    assert len(events) == 1  # rank 0's logger only
    acc = EventAccumulator(str(events[0]), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("attention/decoder.layers.1.self_attn/entropy")]
    assert len(steps) == 2 and steps[0] < steps[1]
    assert {"attention/weight_histogram", "attention/weight_cdf", "attention/token_similarity"} <= set(
        acc.Tags()["images"]
    )


def test_state_keeps_the_schedule_and_the_history_and_an_old_checkpoint_starts_afresh(caplog):
    """A resumed run keeps counting validations (every k-th records) and draws every recorded epoch;
    epochs recorded before blocks carried their stack and layer are left out, with a warning."""
    history = {"epoch 0": {"blocks": {"decoder.layers.0": {"token_similarity": 0.5, "stack": "decoder", "layer": 0}}}}
    recorded = AttentionStats()
    recorded.validations, recorded.similarity_history = 5, history
    assert recorded.state_dict() == {"validations": 5, "similarity_history": history}
    resumed = AttentionStats()
    resumed.load_state_dict(recorded.state_dict())
    assert (resumed.validations, resumed.similarity_history) == (5, history)
    resumed.load_state_dict({})  # a checkpoint written without this callback
    assert (resumed.validations, resumed.similarity_history) == (0, {})
    old = {"epoch 1": {"blocks": {"decoder.layers.0": {"token_similarity": 0.4}}}}
    resumed.load_state_dict({"validations": 7, "similarity_history": {**old, **history}})
    assert (resumed.validations, resumed.similarity_history) == (7, history)
    assert "1 recorded epoch(s) of the checkpoint name no stack and layer" in caplog.text
    # a block naming its stack but not its layer cannot be placed either; an epoch that recorded no block
    # has nothing to leave out
    half = {"epoch 2": {"blocks": {"decoder.layers.0": {"token_similarity": 0.3, "stack": "decoder"}}}}
    resumed.load_state_dict({"similarity_history": {**half, "epoch 3": {}, **history}})
    assert resumed.similarity_history == {"epoch 3": {}, **history}


class Board(TensorBoardLogger):
    """A TensorBoard logger whose writer records ``add_image`` calls and whose metrics are kept."""

    def __init__(self, save_dir):
        super().__init__(save_dir)
        self.images, self.metrics = [], []

    @property
    def experiment(self):
        return SimpleNamespace(
            add_image=lambda tag, image, global_step, dataformats: self.images.append(
                (tag, image.shape, global_step, dataformats)
            )
        )

    def log_metrics(self, metrics, step=None):
        self.metrics.append((metrics, step))


def test_figures_at_the_end_go_to_every_tensorboard_at_the_step(tmp_path, monkeypatch):
    from mmlight.analysis import figures

    drawn = []

    def fake(kind):
        def draw(data, **options):
            drawn.append((kind, data, options))
            fig = figures.new_figure((2, 1))
            fig.subplots().plot([0, 1], [0, 1])
            return fig

        return draw

    monkeypatch.setattr(figures, "layers_figure", fake("layers"))
    monkeypatch.setattr(figures, "similarity_figure", fake("similarity"))
    boards = [Board(tmp_path / "a"), Board(tmp_path / "b")]
    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path), *boards], global_step=42, is_global_zero=True)
    callback = AttentionStats(figures="end")
    stats = {"sites": {}, "blocks": {}}
    callback.last = {"label": "epoch 3", "stats": stats}
    callback.similarity_history = {"epoch 3": {"blocks": {}}}
    callback.on_fit_end(trainer, None)
    callback.teardown(trainer, None, "fit")  # waits for the background thread and logs

    assert drawn == [
        ("layers", stats, {}),
        ("layers", stats, {"cdf": True}),
        ("similarity", callback.similarity_history, {}),
    ]
    tags = ["attention/weight_histogram", "attention/weight_cdf", "attention/token_similarity"]
    for board in boards:
        assert [(tag, step, fmt) for tag, _, step, fmt in board.images] == [(tag, 42, "HWC") for tag in tags]
        assert all(shape == (100, 200, 3) for _, shape, _, _ in board.images)  # 2 x 1 inches at 100 dpi
        logged = {k: step for metrics, step in board.metrics for k in metrics}
        assert logged["attention/figure_seconds"] == 42 and logged["attention/final_wait_seconds"] == 42
        # the wait is wall-clock time (no value known in advance): its sign and its bound, the whole test's time
        waits = [m["attention/final_wait_seconds"] for m, _ in board.metrics if "attention/final_wait_seconds" in m]
        assert len(waits) == 1 and 0 <= waits[0] < 60

    drawn.clear()
    AttentionStats(figures="off").on_fit_end(trainer, None)  # off, or nothing recorded yet: no figures
    AttentionStats(figures="end").on_fit_end(trainer, None)
    trainer.loggers = [CSVLogger(tmp_path)]  # no TensorBoard: nothing drawn
    callback.on_fit_end(trainer, None)
    assert drawn == []


# --- the callback's own logic, on stand-in trainers (fast) -------------------------------------------

attention_stats_module = importlib.import_module("mmlight.callbacks.attention_stats")


class Recorder:
    """A logger stand-in: every ``log_metrics`` call."""

    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, dict(metrics)))


def stand_in_trainer(step=7, rank_zero=True, loggers=None):
    return SimpleNamespace(
        global_step=step,
        is_global_zero=rank_zero,
        sanity_checking=False,
        current_epoch=2,
        loggers=[Recorder()] if loggers is None else loggers,
    )


def tiny_lm_and_batch():
    torch.manual_seed(0)
    task = LanguageModel(model=tiny_transformer())
    return task, {"input": torch.randint(2, 20, (3, 6)), "target": torch.randint(2, 20, (3, 6))}


def test_defaults_and_argument_edges():
    stats = AttentionStats()
    assert (stats.every_n_epochs, stats.num_samples, stats.figures, stats.keep_bytes) == (10, 32, "every", 256 * 2**20)
    assert stats.last is None and stats.validations == 0 and stats.batches == [] and stats._pending == []
    edge = AttentionStats(every_n_epochs=1, num_samples=1, keep_mib=0)
    assert (edge.num_samples, edge.keep_bytes) == (1, 0)
    assert AttentionStats(keep_mib=3).keep_bytes == 3 * 1024 * 1024


def test_sample_collection_stops_at_num_samples_without_empty_batches():
    stats = AttentionStats(num_samples=4)
    trainer = stand_in_trainer()
    for i in range(4):
        stats.on_validation_batch_start(trainer, None, (torch.full((3, 2), float(i)), torch.zeros(3)), i)
    assert [b[0].shape[0] for b in stats.batches] == [3, 1]  # 3 + 1 = 4 samples, then nothing more
    assert stats.batches[1][0].eq(1.0).all()  # the second batch's first sample


def test_a_recording_is_due_every_k_validations_with_the_callbacks_settings(monkeypatch):
    """Validations 0, 2, 4 record (every_n_epochs 2), each with the callback's settings and memory
    bound; without TensorBoard no figures are asked for; the loop's own time is logged each time."""
    calls = []

    class FakeRecording:
        blocks = {"blocks.0": 0.5}

    def fake_record(module, batches, settings, keep_bytes):
        calls.append((module, len(batches), settings, keep_bytes))
        return FakeRecording()

    monkeypatch.setattr(attention_stats_module, "record_statistics", fake_record)
    submitted = []
    stats = AttentionStats(every_n_epochs=2, keep_mib=1)
    monkeypatch.setattr(stats, "_submit", lambda trainer, job, *args: submitted.append((job, args)))
    stats.batches = [("x",)]
    trainer = stand_in_trainer()
    for _ in range(5):
        stats.on_validation_epoch_start(trainer, "module")
        before = time.perf_counter()
        stats.on_validation_epoch_end(trainer, "module")
        took = time.perf_counter() - before
        for _, scalars in trainer.loggers[0].logged[-2:]:
            for key in ("attention/validation_seconds", "attention/seconds"):
                if key in scalars:
                    assert 0 <= scalars[key] <= took + 1e-3
    assert stats.validations == 5
    assert calls == [("module", 1, stats.settings, 2**20)] * 3
    assert [(job, args[1], args[2]) for job, args in submitted] == [
        (attention_stats_module.finish_recording, "epoch 2", None)
    ] * 3


def test_finish_recording_keeps_per_layer_values_and_times_itself():
    from mmlight.analysis.stats import metric_rows, record_statistics

    task, batch = tiny_lm_and_batch()
    recording = record_statistics(task, [batch], keep_bytes=2**30)
    before = time.perf_counter()
    done = attention_stats_module.finish_recording(recording, "epoch 3", None)
    took = time.perf_counter() - before
    assert done["label"] == "epoch 3" and done["images"] == {}
    layer_rows = {
        f"attention/{layer}/{metric}": value
        for layer, head, metric, value in metric_rows(done["stats"])
        if head is None
    }
    scalars = dict(done["scalars"])
    assert 0 <= scalars.pop("attention/reduce_seconds") <= took
    assert scalars == {key: value for key, value in layer_rows.items() if value is not None}  # no per-head values
    assert done["stats"]["sites"].keys() == collect_statistics(task, [batch])["sites"].keys()
    padding = {"input": torch.ones(2, 6, dtype=torch.long), "target": torch.ones(2, 6, dtype=torch.long)}
    empty = attention_stats_module.finish_recording(record_statistics(task, [padding]), "epoch 4", None)
    assert any(value is None for _, _, _, value in metric_rows(empty["stats"]))  # no real query: nothing measured
    assert None not in empty["scalars"].values()  # and nothing logged for it


def test_redraw_draws_the_last_recording_again_and_sets_no_new_last():
    task, batch = tiny_lm_and_batch()
    stats = collect_statistics(task, [batch])
    before = time.perf_counter()
    done = attention_stats_module.redraw({"label": "epoch 9", "stats": stats}, {"epoch 9": {"blocks": stats["blocks"]}})
    took = time.perf_counter() - before
    assert done["label"] == "epoch 9" and done["stats"] is None
    assert set(done["images"]) == {"attention/weight_histogram", "attention/weight_cdf", "attention/token_similarity"}
    assert 0 < done["scalars"]["attention/figure_seconds"] <= took


def test_the_massive_recording_logs_its_seconds_and_draws_the_figure_under_its_label(monkeypatch):
    from mmlight.analysis import figures

    task, batch = tiny_lm_and_batch()
    stats = AttentionStats(massive_activations=True)
    stats.batches = [batch]
    trainer = stand_in_trainer(step=12)
    submitted = []
    stats._submit = lambda trainer, job, *args: submitted.append((job, args))
    before = time.perf_counter()
    stats._record_massive(trainer, task, "epoch 4", draw=True)
    took = time.perf_counter() - before
    ((step, scalars),) = trainer.loggers[0].logged
    assert step == 12 and 0 < scalars["massive/seconds"] <= took
    result = massive_activations(task, [batch], stats.massive)
    assert submitted == [(attention_stats_module.draw_massive, (result, "epoch 4"))]
    stats._record_massive(trainer, task, "epoch 5", draw=False)
    assert len(submitted) == 1 and len(trainer.loggers[0].logged) == 2  # logged, not drawn

    drawn, real = [], figures.massive_figure
    monkeypatch.setattr(figures, "massive_figure", lambda results: drawn.append(results) or real(results))
    before = time.perf_counter()
    done = attention_stats_module.draw_massive(result, "epoch 4")
    took = time.perf_counter() - before
    assert drawn == [{"epoch 4": result}]
    assert done["label"] == "epoch 4" and done["stats"] is None  # not a recording: `last` stays
    assert set(done["images"]) == {"massive/activations"} and done["images"]["massive/activations"].ndim == 3
    assert 0 < done["scalars"]["massive/figure_seconds"] <= took


def finished(label, stats, scalars=None):
    future = Future()
    future.set_result({"label": label, "stats": stats, "scalars": scalars or {}, "images": {}})
    return future


def test_finished_results_are_logged_in_order_at_their_steps_and_remember_the_last_statistics():
    stats = AttentionStats()
    trainer = stand_in_trainer(step=50)
    stats._pending = [(10, finished("epoch 0", {"s": 0}, {"a": 1.0})), (20, finished("epoch 1", None, {"b": 2.0}))]
    stats._log_finished(trainer, wait=False)
    assert trainer.loggers[0].logged == [(10, {"a": 1.0}), (20, {"b": 2.0})]
    assert stats.last == {"label": "epoch 0", "stats": {"s": 0}}  # a redraw (stats None) does not replace it
    blocked = Future()  # not done: without waiting, it and what follows stay pending
    stats._pending = [(30, blocked), (40, finished("epoch 2", {"s": 2}))]
    stats._log_finished(trainer, wait=False)
    assert len(stats._pending) == 2 and len(trainer.loggers[0].logged) == 2


def waiting_job(release: threading.Event, ran: list):
    """A background job that waits (at most 2 s) to be released, noting its thread and whether it was."""

    def job():
        ran.append((threading.current_thread().name, release.wait(2.0)))
        return {"label": "epoch 0", "stats": {"s": 1}, "scalars": {}, "images": {}}

    return job


def test_one_background_thread_runs_the_jobs_in_order():
    """The second job cannot start while the first waits for it: one named worker thread."""
    stats, trainer, ran = AttentionStats(), stand_in_trainer(), []
    release = threading.Event()
    stats._submit(trainer, waiting_job(release, ran))
    stats._submit(trainer, lambda: (release.set(), {"label": "x", "stats": None, "scalars": {}, "images": {}})[1])
    stats._log_finished(trainer, wait=True)
    assert ran == [("attention-stats_0", False)]  # the first job timed out: the second ran only after it
    stats.teardown(trainer, None, "fit")


def test_the_loop_never_waits_for_the_background_thread_but_the_end_of_fit_does(tmp_path):
    stats, ran = AttentionStats(figures="end"), []
    trainer = stand_in_trainer(loggers=[Recorder(), TensorBoardLogger(tmp_path)])
    release = threading.Event()
    stats._submit(trainer, waiting_job(release, ran))
    before = time.perf_counter()
    stats.on_train_epoch_end(trainer, None)
    stats._validation_start = time.perf_counter()
    stats.on_validation_epoch_end(trainer, None)  # not due (no batches), but it logs what is finished
    assert time.perf_counter() - before < 1.0 and len(stats._pending) == 1
    release.set()
    redraws = []
    stats._submit = lambda trainer, job, *args: redraws.append((job, args))
    stats.on_fit_end(trainer, None)  # waits for the recording, then redraws from it
    assert stats.last == {"label": "epoch 0", "stats": {"s": 1}}
    assert redraws == [(attention_stats_module.redraw, (stats.last, stats.similarity_history))]


def test_the_end_of_the_run_waits_and_says_how_long(tmp_path):
    stats, trainer, ran = AttentionStats(), stand_in_trainer(), []
    release = threading.Event()
    stats._submit(trainer, waiting_job(release, ran))
    threading.Timer(0.2, release.set).start()
    before = time.perf_counter()
    stats.teardown(trainer, None, "fit")
    took = time.perf_counter() - before
    wait = trainer.loggers[0].logged[-1][1]["attention/final_wait_seconds"]
    assert 0.1 < wait <= took and stats._worker is None and stats._pending == []


def test_a_failed_run_cancels_what_waits_and_does_not_wait_for_what_runs():
    stats, trainer, ran = AttentionStats(), stand_in_trainer(), []
    release = threading.Event()
    stats._submit(trainer, waiting_job(release, ran))
    queued = []
    stats._submit(trainer, lambda: queued.append(1))
    second = stats._pending[1][1]
    before = time.perf_counter()
    stats.on_exception(trainer, None, RuntimeError("boom"))
    assert time.perf_counter() - before < 1.0  # the running job is not waited for
    assert second.cancelled() and stats._worker is None and stats._pending == []
    release.set()
    time.sleep(0.1)
    assert queued == []
    stats.on_exception(trainer, None, RuntimeError("again"))  # nothing running: nothing to do


def test_massive_activations_are_off_by_default_and_when_on_logged_as_the_analysis_computes_them(tmp_path):
    assert AttentionStats().massive is None
    # thresholds low enough that entries count as massive: the settings given are the ones applied
    settings = MassiveSettings(top_k=2, min_magnitude=0.0, min_ratio=1.5)
    stats_cb = AttentionStats(
        every_n_epochs=1, num_samples=10, figures="off", massive_activations=True, massive_settings=settings
    )
    task, data, metrics = tiny_run(tmp_path, [stats_cb], epochs=1)
    logged = [r for r in csv.DictReader(open(metrics)) if r.get("massive/decoder.layers.1/ratio")]
    assert len(logged) == 1 and float(logged[0]["massive/seconds"]) > 0
    # per block the median, the mean largest, the ratio and the count; not top2 .. top_k
    massive_columns = {column for column in logged[0] if column.startswith("massive/")}
    blocks = ("decoder.layers.0", "decoder.layers.1")
    metrics_logged = ("median", "top1", "ratio", "massive")
    assert massive_columns == {"massive/seconds"} | {f"massive/{b}/{m}" for b in blocks for m in metrics_logged}
    want = massive_activations(task, stats_cb.batches, settings)  # after training = the only epoch's recording
    assert want != massive_activations(task, stats_cb.batches)  # the default thresholds count another number
    for block in blocks:
        entry = want["blocks"][block]
        assert float(logged[0][f"massive/{block}/ratio"]) == pytest.approx(entry["ratio"], rel=1e-6)
        assert float(logged[0][f"massive/{block}/median"]) == pytest.approx(entry["median"], rel=1e-6)
        assert float(logged[0][f"massive/{block}/top1"]) == pytest.approx(entry["top_mean"][0], rel=1e-6)
        assert float(logged[0][f"massive/{block}/massive"]) == entry["massive"]
