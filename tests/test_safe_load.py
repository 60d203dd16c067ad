"""Files from elsewhere are read as data (mmlight.safe_load): a pickle that would create a marker file when
unpickled is refused by every loader a user reaches (``model.pretrained`` as a ``.ckpt`` through the
fine-tuning config, or a timm ``.pth``; ``load_from_checkpoint``; ``mmlight prepare cifar10`` on a
real-format archive), with a message that names the file, and the marker never appears. Honest files load,
and the documented conversion of a trusted checkpoint works. The package never unpickles in full."""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
import shlex
import subprocess
import sys
import tarfile
import tokenize
from pathlib import Path, PurePosixPath

import lightning
import numpy as np
import pytest
import torch

from mmlight.commands.prepare import main as prepare_main
from mmlight.models import BeamSearchConfig, ReweightedViT, ReweightingSpec, TransformerConfig, ViTConfig
from mmlight.models.pretrained import read_pretrained
from mmlight.safe_load import CONVERT_COMMAND, PlainUnpickler, RefusedFile, load_checkpoint, refusing_code
from mmlight.tasks import ImageClassifier
from tests.helpers import py2_pickle
from tests.helpers.user_types import Unlisted

ROOT = Path(__file__).resolve().parents[1]
REFUSED = "holds objects mmlight does not load"
MICRO = ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=6, backend="reference")


class CreatesMarker:
    """Unpickled, it runs ``touch <marker>`` through ``os.system``: the marker's existence shows the code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    # the payload works: a full unpickling creates the marker (so its absence below means nothing ran)
    pickle.loads(pickle.dumps(CreatesMarker(path)))
    assert path.exists()
    path.unlink()
    return path


def micro_checkpoint(path: Path, **extra) -> Path:
    """An ImageClassifier checkpoint of the micro ViT (its ``model.vit.*`` weights and hyperparameters), with
    ``extra`` entries."""
    torch.manual_seed(0)
    task = ImageClassifier(MICRO)
    state = {f"model.{k}": v for k, v in task.model.state_dict().items()}
    version = {"pytorch-lightning_version": lightning.__version__}
    torch.save({"state_dict": state, "hyper_parameters": dict(task.hparams), **version, **extra}, path)
    return path


def check_refused(refused: pytest.ExceptionInfo, path, marker: Path, named: str = "posix.system") -> None:
    """The whole refusal: what the file holds, why nothing else is loaded, and the command that converts it."""
    path = Path(path)
    converted = path.with_name(f"{path.stem}-weights{path.suffix}")
    assert str(refused.value) == (
        f"{path} {REFUSED}: {named}. mmlight reads weights and checkpoints as data only, so that no file can "
        "run code when it is loaded. Only if you trust the file (a checkpoint of your own, from an earlier mmlight "
        "or with other objects in its hyperparameters), convert it once to plain weights (docs/finetuning.md): "
        f"{CONVERT_COMMAND} {shlex.quote(str(path))} {shlex.quote(str(converted))}"
    )
    assert not marker.exists()


# ----------------------------------------------------------------------------- checkpoints and weights


def test_mmlight_fit_refuses_a_code_running_checkpoint_named_as_pretrained_by_the_finetuning_config(
    tmp_path, marker, monkeypatch, capsys
):
    """``mmlight fit`` with configs/finetune/digits_6to9.yaml and ``model.pretrained`` a ``.ckpt`` whose
    pickle would run code: it stops before any work with the refusal as its error."""
    from mmlight.cli import main

    path = micro_checkpoint(tmp_path / "last.ckpt", callbacks={"payload": CreatesMarker(marker)})
    monkeypatch.setattr(sys, "argv", ["mmlight"])
    args = ["fit", "--config", str(ROOT / "configs/finetune/digits_6to9.yaml"), "--model.init_args.model.pretrained"]
    args += [str(path), "--data.init_args.cache_dir", str(tmp_path / "digits")]
    with pytest.raises(SystemExit) as stop:
        main([*args, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    said = capsys.readouterr().err
    assert stop.value.code == 2 and f"error: {path} {REFUSED}: posix.system." in said
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_a_code_running_pth_is_refused_by_timm_s_reader_naming_the_file(tmp_path, marker):
    path = tmp_path / "deit.pth"
    torch.save({"model": {"w": torch.zeros(2)}, "args": CreatesMarker(marker)}, path)
    with pytest.raises(RefusedFile) as refused:
        read_pretrained(str(path))
    check_refused(refused, path, marker)


class NotData:
    """A class of the tests' own: pickled by reference, which ``weights_only`` refuses."""


def test_a_checkpoint_with_several_objects_names_them_all_and_a_legacy_file_names_its_first(tmp_path, marker):
    """A zip checkpoint: every global torch's allow-list lacks, sorted (torch lists them); a file in torch's
    legacy (non-zip) format: the global torch's refusal names (it stops at the first)."""
    several = tmp_path / "several.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "a": CreatesMarker(marker), "b": NotData()}, several)
    with pytest.raises(RefusedFile) as refused:
        load_checkpoint(several)
    check_refused(refused, several, marker, named=f"posix.system, {__name__}.NotData")
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"w": torch.zeros(2), "a": CreatesMarker(marker)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(RefusedFile) as refused:
        load_checkpoint(legacy)
    check_refused(refused, legacy, marker)


def test_a_refusal_that_names_no_object_gives_torchs_reason(tmp_path, marker):
    """A protocol-4 pickle (one ``FRAME`` opcode, which torch's ``weights_only`` reader does not take) holds no
    global to name: the refusal says what the file is not, with torch's reason."""
    path = tmp_path / "protocol4.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path, pickle_protocol=4)
    with pytest.raises(RefusedFile) as refused:
        load_checkpoint(path)
    reason = f"Unsupported operand {pickle.FRAME[0]}"
    check_refused(
        refused, path, marker, named=f"objects other than tensors, numbers, strings and containers ({reason})"
    )


def test_a_refusal_with_neither_a_global_nor_torchs_reason_says_only_what_the_file_is_not(tmp_path, marker):
    """An unpickling error inside the block that names no global and carries no ``WeightsUnpickler`` reason
    (a reader other than torch's): the refusal gives the general description alone, with no empty reason."""
    path = tmp_path / "plain.pkl"
    path.write_bytes(b"not a zip archive")
    with pytest.raises(RefusedFile) as refused, refusing_code(path):
        raise pickle.UnpicklingError("a reader's own refusal")
    check_refused(refused, path, marker, named="objects other than tensors, numbers, strings and containers")


def test_a_checkpoint_is_read_to_the_map_location_and_as_data_whatever_the_environment_says(
    tmp_path, marker, monkeypatch
):
    """``map_location`` reaches torch (tensors on the meta device here), and torch's
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, which turns a ``torch.load`` that leaves ``weights_only`` unset into
    a full unpickling, does not turn off the refusal."""
    path = micro_checkpoint(tmp_path / "task.ckpt")
    loaded = load_checkpoint(path, map_location="meta")
    assert loaded["state_dict"] and all(t.is_meta for t in loaded["state_dict"].values())
    assert all(not t.is_meta for t in load_checkpoint(path)["state_dict"].values())  # the default: the CPU
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    unsafe = micro_checkpoint(tmp_path / "unsafe.ckpt", loops={"payload": CreatesMarker(marker)})
    with pytest.raises(RefusedFile) as refused:
        load_checkpoint(unsafe)
    check_refused(refused, unsafe, marker)


def test_load_from_checkpoint_refuses_a_code_running_checkpoint(tmp_path, marker):
    path = micro_checkpoint(tmp_path / "task.ckpt", loops={"payload": CreatesMarker(marker)})
    with pytest.raises(RefusedFile) as refused:
        ImageClassifier.load_from_checkpoint(path, map_location="cpu")
    check_refused(refused, path, marker)


def test_load_from_checkpoint_passes_lightnings_arguments_on_and_reads_as_data_whatever_the_environment_says(
    tmp_path, marker, monkeypatch
):
    """A task's ``load_from_checkpoint`` hands ``map_location``, ``hparams_file`` and ``strict`` to Lightning's,
    each in its place, and keeps reading as data under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``."""
    path = micro_checkpoint(tmp_path / "task.ckpt")
    places = []  # torch.load calls a callable map_location once per storage, with the saved location

    def to_cpu(storage, location):
        places.append(location)
        return storage

    ImageClassifier.load_from_checkpoint(path, map_location=to_cpu)
    assert places and set(places) == {"cpu"}
    # Lightning replaces the checkpoint's hyperparameters by the file's: without a model config the task
    # builds the default DeiT-small, which the micro ViT's weights do not fit
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("label_smoothing: 0.25\n")
    with pytest.raises(ValueError, match=r"^the checkpoint was written by another model or config: \d+ parameter"):
        ImageClassifier.load_from_checkpoint(path, hparams_file=str(hparams))
    extra = micro_checkpoint(tmp_path / "extra.ckpt")
    checkpoint = torch.load(extra, weights_only=True)
    checkpoint["state_dict"]["model.unused"] = torch.zeros(1)
    torch.save(checkpoint, extra)
    unknown = (
        r"^the checkpoint was written by another model or config: 1 unknown to this model, e.g. \['model.unused'\]\.$"
    )
    with pytest.raises(ValueError, match=unknown):
        ImageClassifier.load_from_checkpoint(extra)
    loaded = ImageClassifier.load_from_checkpoint(extra, strict=False)
    assert loaded.state_dict().keys() == checkpoint["state_dict"].keys() - {"model.unused"}
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, checkpoint["state_dict"][key], rtol=0, atol=0)
    del checkpoint["state_dict"]["model.unused"]
    checkpoint["state_dict"]["model.vit.head.bias"] = torch.zeros(7)  # 6 classes in the model
    torch.save(checkpoint, extra)
    with pytest.raises(ValueError, match=r"shapes differ: model.vit.head.bias \(7,\) vs \(6,\)"):
        ImageClassifier.load_from_checkpoint(extra, strict=False)  # not a key: checked whatever strict says
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    unsafe = micro_checkpoint(tmp_path / "unsafe.ckpt", loops={"payload": CreatesMarker(marker)})
    with pytest.raises(RefusedFile) as refused:
        ImageClassifier.load_from_checkpoint(unsafe)
    check_refused(refused, unsafe, marker)


def test_honest_checkpoints_load_with_config_records_paths_and_the_old_module_of_reweighting_spec(
    tmp_path, monkeypatch
):
    """A task built in Python pickles its config records (ViTConfig and ReweightingSpec; a translator's
    TransformerConfig and BeamSearchConfig); a hyperparameter may be a path; a checkpoint of the first mmlight
    names ReweightingSpec under ``mmlight.models.vit``, where it was defined."""
    monkeypatch.setattr(ReweightingSpec, "__module__", "mmlight.models.vit")  # pickled as the old one was
    records = {"translator": TransformerConfig(vocab_size=9), "beam": BeamSearchConfig(beam_size=2)}
    path = micro_checkpoint(tmp_path / "old.ckpt", extra={"root": PurePosixPath("/data"), **records})
    monkeypatch.undo()
    assert b"mmlight.models.vit\nReweightingSpec" in _pickle_of(path)
    loaded = load_checkpoint(path)
    assert loaded["hyper_parameters"]["model"] == MICRO
    assert loaded["extra"] == {"root": PurePosixPath("/data"), **records}
    task = ImageClassifier.load_from_checkpoint(path, map_location="cpu")
    assert task.model.config == MICRO
    assert all(torch.equal(v, loaded["state_dict"][f"model.{k}"]) for k, v in task.model.state_dict().items())


def test_a_safe_read_keeps_the_types_registered_for_lightning_s_own_reads(tmp_path):
    """``--ckpt_path`` resumes go through Lightning's plain ``torch.load(weights_only=True)``, which needs the
    config records registered for good; a read through ``load_checkpoint`` or ``load_from_checkpoint`` before
    it (a fine-tuning start, the Python API) must not unregister them."""
    path = micro_checkpoint(tmp_path / "task.ckpt")
    load_checkpoint(path)
    ImageClassifier.load_from_checkpoint(path, map_location="cpu")
    assert torch.load(path, weights_only=True)["hyper_parameters"]["model"] == MICRO


def _pickle_of(checkpoint: Path) -> bytes:
    with torch.serialization._open_zipfile_reader(open(checkpoint, "rb")) as zipped:  # noqa: SIM115
        return zipped.get_record("data.pkl")


def test_a_trusted_checkpoint_with_another_type_is_refused_naming_it_and_the_documented_command_converts_it(
    tmp_path,
):
    """The refusal names the type and gives the command of docs/finetuning.md; that command, run as the doc
    writes it, gives a file that loads as pretrained weights, and from Python with the model's options."""
    path = micro_checkpoint(tmp_path / "mine.ckpt", extra=Unlisted())
    with pytest.raises(RefusedFile) as refused:
        read_pretrained(str(path))
    converted = tmp_path / "mine-weights.ckpt"
    assert f"{path} {REFUSED}: tests.helpers.user_types.Unlisted." in str(refused.value)
    assert str(refused.value).endswith(f"{CONVERT_COMMAND} {path} {converted}")
    documented = [c for c in re.findall(r"^python -c .*$", (ROOT / "docs/finetuning.md").read_text(), re.M)]
    assert documented == [f"{CONVERT_COMMAND} old.ckpt old-weights.ckpt"]
    command = [sys.executable, *shlex.split(documented[0])[1:-2], str(path), str(converted)]  # this environment's
    subprocess.run(command, check=True, cwd=ROOT)  # from the root, where Unlisted can be imported
    weights = read_pretrained(str(converted))
    want = torch.load(path, weights_only=False)["state_dict"]  # the test's own file, trusted
    assert weights.keys() == {k.removeprefix("model.vit.") for k in want}
    assert all(torch.equal(v, want[f"model.vit.{k}"]) for k, v in weights.items())
    model = ReweightedViT(ViTConfig(**{**MICRO.__dict__, "pretrained": str(converted)}))
    assert model.pretrained_report.dropped == {} and model.pretrained_report.new == []
    task = ImageClassifier.load_from_checkpoint(converted, map_location="cpu", model=MICRO)
    assert all(torch.equal(v, want[f"model.{k}"]) for k, v in task.model.state_dict().items())


# ----------------------------------------------------------------------------- CIFAR archives


def write_cifar10_archive(folder: Path, replace: dict[str, dict]) -> Path:
    """``cifar-10-python.tar.gz`` as the official one is laid out (``cifar-10-batches-py/`` with byte-string
    keyed dict pickles of uint8 ``data`` rows and ``labels``), with the contents of the ``replace`` members."""
    rng = np.random.default_rng(0)
    members = {
        name: {b"batch_label": b"b", b"labels": [1, 2], b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8)}
        for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
    }
    members["batches.meta"] = {b"label_names": [f"c{i}".encode() for i in range(10)], b"num_vis": 3072}
    members.update(replace)
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "cifar-10-python.tar.gz", "w:gz") as tar:
        for name, content in members.items():
            data = pickle.dumps(content, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder / "cifar-10-python.tar.gz"


@pytest.mark.parametrize("member", ["data_batch_1", "batches.meta"])
def test_mmlight_prepare_cifar10_refuses_a_code_running_pickle_in_the_archive(tmp_path, marker, member, capsys):
    honest = tmp_path / "honest"
    write_cifar10_archive(honest, {})
    prepare_main(["cifar10", "--src", str(honest), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert "train 10 samples (0 skipped), test 2 samples (0 skipped)" in capsys.readouterr().out
    payload = {b"label_names": [b"c"] * 10, b"extra": CreatesMarker(marker)}
    archive = write_cifar10_archive(tmp_path / "raw", {member: payload})
    with pytest.raises(SystemExit) as stop:
        prepare_main(["cifar10", "--src", str(tmp_path / "raw"), "--out", str(tmp_path / "out2"), "--workers", "1"])
    said = capsys.readouterr().err
    assert stop.value.code == 2 and said.startswith("mmlight prepare: error: ")
    assert f"{archive}:cifar-10-batches-py/{member} {REFUSED}: posix.system." in said
    assert not marker.exists()


def test_the_plain_unpickler_reads_arrays_under_numpy_1_and_2_names_and_refuses_other_numpy_globals():
    """The official files were written by NumPy 1 (``numpy.core.multiarray._reconstruct``), a re-pickle by
    NumPy 2 names ``numpy._core``: both give the array; a NumPy function that is no array rebuild is refused."""
    array = np.arange(6, dtype=np.uint8).reshape(2, 3)
    data = pickle.dumps({b"data": array, b"labels": [1, 2], b"batch_label": b"b"}, protocol=2)
    assert b"numpy._core.multiarray\n_reconstruct" in data
    for module in (b"numpy._core.multiarray", b"numpy.core.multiarray"):
        loaded = PlainUnpickler(data.replace(b"numpy._core.multiarray", module), "batch").load()
        assert loaded.keys() == {b"data", b"labels", b"batch_label"} and loaded[b"labels"] == [1, 2]
        assert loaded[b"data"].dtype == np.uint8 and np.array_equal(loaded[b"data"], array)
    with pytest.raises(RefusedFile) as refused:
        PlainUnpickler(pickle.dumps(np.save, protocol=2), "batch").load()
    assert str(refused.value).startswith(f"batch {REFUSED}: numpy.save.")


def test_the_plain_unpickler_reads_python_2_strings_as_bytes_and_arrays_whose_memory_is_not_ascii():
    """The official CIFAR pickles, as Python 2 wrote them: keys, names and each array's memory are Python 2
    strings, read as bytes (Python 3's default, ASCII, fails on the memory; latin1 would make the keys str)."""
    array = (np.arange(24, dtype=np.uint8) * 11).reshape(2, 12)  # bytes up to 253: not ASCII
    data = py2_pickle.dumps({b"data": array, b"labels": [3, 0], b"filenames": [b"a.png", b"b.png"]})
    with pytest.raises(UnicodeDecodeError):
        pickle.loads(data)  # what an unpickler without encoding="bytes" does with it
    loaded = PlainUnpickler(data, "data_batch_1").load()
    assert loaded.keys() == {b"data", b"labels", b"filenames"} and loaded[b"filenames"] == [b"a.png", b"b.png"]
    assert loaded[b"labels"] == [3, 0] and np.array_equal(loaded[b"data"], array)
    text = PlainUnpickler(data, "data_batch_1", encoding="latin1").load()  # the encoding argument is used
    assert text.keys() == {"data", "labels", "filenames"} and np.array_equal(text["data"], array)


def test_a_persistent_id_is_refused_by_name():
    """A pickle that asks its unpickler for an object by persistent id (how torch's zip files reference
    storages) gets nothing: the plain unpickler knows no such objects."""
    data = py2_pickle.PROTO + b"U\x07storageQ" + py2_pickle.STOP  # BINPERSID of the Python 2 string 'storage'
    with pytest.raises(RefusedFile) as refused:
        PlainUnpickler(data, "data_batch_1").load()
    assert str(refused.value) == "data_batch_1 holds objects mmlight does not load: a persistent id b'storage'"


def test_the_refusal_says_what_a_plain_file_holds_and_what_to_do():
    with pytest.raises(RefusedFile) as refused:
        PlainUnpickler(pickle.dumps(os.system, protocol=2), "data_batch_1").load()
    assert str(refused.value) == (
        "data_batch_1 holds objects mmlight does not load: posix.system. The file should hold only dicts, lists, "
        "strings, bytes, numbers and NumPy arrays; it may have been altered: get it again from its official source"
    )


def test_the_plain_unpickler_reads_python_3_protocol_5_arrays_with_str_keys():
    """A re-pickle under Python 3 at protocol 5 (``pickle.HIGHEST_PROTOCOL``) has str keys and rebuilds an array
    from its bytes (``numpy._core.numeric._frombuffer``, ``numpy.core`` under NumPy 1): the same values."""
    array = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    data = pickle.dumps({"data": array, "labels": [1, 2, 0], "batch_label": "b"}, protocol=5)
    assert b"numpy._core.numeric" in data and b"_frombuffer" in data
    loaded = PlainUnpickler(data, "batch").load()
    assert loaded.keys() == {"data", "labels", "batch_label"} and loaded["labels"] == [1, 2, 0]
    assert loaded["data"].dtype == np.uint8 and np.array_equal(loaded["data"], array)
    unpickler = PlainUnpickler(b"", "batch")  # the name NumPy 1 writes gives the same function
    rebuild = unpickler.find_class("numpy._core.numeric", "_frombuffer")
    assert unpickler.find_class("numpy.core.numeric", "_frombuffer") is rebuild
    assert np.array_equal(rebuild(array.tobytes(), np.dtype(np.uint8), (3, 4), "C"), array)
    with pytest.raises(RefusedFile, match="numpy._core.numeric.fromfile"):
        unpickler.find_class("numpy._core.numeric", "fromfile")


# ----------------------------------------------------------------------------- the package's own code

#: what unpickles with arbitrary globals: torch's full loader, the pickle module's loaders, NumPy's pickles
UNSAFE = re.compile(r"weights_only\s*=\s*False|\bpickle\s*\.\s*(loads?|Unpickler)\b|allow_pickle\s*=\s*True")
#: (file, the function or class) where the package reads pickles, restricted
ALLOWED = {("mmlight/safe_load.py", "load_checkpoint"), ("mmlight/safe_load.py", "PlainUnpickler")}


def code_lines(source: str) -> dict[int, str]:
    """The source's lines without strings and comments (messages and docs may name the unsafe calls)."""
    lines: dict[int, str] = {}
    dropped = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in dropped:
            lines[token.start[0]] = lines.get(token.start[0], "") + " " + token.string
    return lines


def enclosing(tree: ast.Module, line: int) -> set[str]:
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.lineno <= line <= node.end_lineno
    }


def unsafe_loads(root: Path) -> list[str]:
    """``file:line: code`` of every unsafe load in the package outside :data:`ALLOWED`, and of every
    ``torch.load`` call that does not say ``weights_only=True``."""
    found = []
    for path in sorted((root / "mmlight").rglob("*.py")):
        name, source = path.relative_to(root).as_posix(), path.read_text()
        tree = ast.parse(source)
        for line, code in code_lines(source).items():
            if UNSAFE.search(code) and not any((name, e) in ALLOWED for e in enclosing(tree, line)):
                found.append(f"{name}:{line}:{code}")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if ast.unparse(call.func) == "torch.load" and not any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in call.keywords
            ):
                found.append(f"{name}:{call.lineno}: {ast.unparse(call)}")
    return found


def test_the_package_unpickles_only_through_the_safe_loaders(tmp_path):
    assert unsafe_loads(ROOT) == []
    # the check finds each kind: a copy of the package with one unsafe line per kind in a module
    copy = tmp_path / "mmlight"
    copy.mkdir()
    (copy / "bad.py").write_text(
        "import pickle, numpy, torch\n"
        "a = torch.load(p, weights_only = False)\n"
        "b = pickle.loads(data)  # the CIFAR way\n"
        "c = numpy.load(f, allow_pickle=True)\n"
        "d = torch.load(p)\n"
        "class PlainUnpickler(pickle.Unpickler):\n"
        "    pass\n"
        "e = 'pickle.loads(data) in a message'\n"
    )
    found = unsafe_loads(tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "3", "4", "6", "2", "5"]
