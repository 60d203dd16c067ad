"""The package leans on the public API of third-party libraries: no attribute access to an underscore name
that mmlight does not define itself (``trainer._checkpoint_connector``, ``torch._dynamo``), and no override of a
third-party class's underscore method, except the entries of :data:`ALLOWED`, each with its reason."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (file, underscore name) -> why no public API does it. Lightning or torch may change these in a minor release:
#: each has a test of the behaviour it gives, which fails when they do.
ALLOWED = {
    ("mmlight/callbacks/requeue.py", "_accelerator_connector"): (
        "the SLURMEnvironment plugin (its auto_requeue and requeue_signal) of a single-device run: "
        "trainer.strategy.cluster_environment exists only on parallel strategies (tests/callbacks/test_requeue.py)"
    ),
    ("mmlight/callbacks/requeue.py", "_checkpoint_connector"): (
        "hpc_save_path: the hpc_ckpt_<n>.ckpt name that Lightning's own resume and mmlight's --ckpt_path last "
        "look for; no public function numbers it (tests/callbacks/test_requeue.py)"
    ),
    ("mmlight/callbacks/checkpoint.py", "_should_skip_saving_checkpoint"): (
        "ModelCheckpoint has no public hook to write last.ckpt at an epoch end once a step trigger is set "
        "(tests/callbacks/test_checkpoint.py)"
    ),
    ("mmlight/callbacks/checkpoint.py", "_save_last_checkpoint"): "as _should_skip_saving_checkpoint",
    ("mmlight/callbacks/checkpoint.py", "_monitor_candidates"): "as _should_skip_saving_checkpoint",
    ("mmlight/callbacks/progress.py", "_get_train_description"): (
        "RichProgressBar's only way to change the training description (steps out of max_steps); "
        "tests/callbacks/test_progress.py checks the text"
    ),
    ("mmlight/lightning_cli.py", "_parse_ckpt_path"): (
        "LightningCLI's only step between parsing and instantiation where --ckpt_path is known and the config "
        "can still be changed (tests/test_cli.py)"
    ),
    ("mmlight/data/image_decode.py", "_typed_storage"): (
        "a batch tensor in shared memory inside a DataLoader worker, as torch's default_collate makes it; "
        "torch has no public allocator for it"
    ),
    ("mmlight/data/image_decode.py", "_new_shared"): "as _typed_storage",
    ("mmlight/kernels/cross_entropy.py", "_assert_async"): (
        "a device-side check of the targets without a host sync, what F.cross_entropy does on CUDA; "
        "no public equivalent"
    ),
    ("mmlight/tasks/compiling.py", "_dynamo"): (
        "torch._dynamo.exc.TorchDynamoException, the base class of torch.compile's errors, is not re-exported "
        "under torch.compiler"
    ),
}


def defined_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name mmlight defines: functions, classes, assigned names and attributes, arguments."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def underscore_uses(root: Path = ROOT, package: str = "mmlight") -> set[tuple[str, str]]:
    """``(file, name)`` of every read of a third-party underscore attribute (``x._name`` with ``_name`` not
    defined in mmlight, or ``from a._b import c``), and of every method that overrides a third-party class's
    underscore method, in the package ``package`` under ``root``."""
    trees = {path: ast.parse(path.read_text()) for path in sorted((root / package).rglob("*.py"))}
    ours, found = defined_names(trees), set()
    for path, tree in trees.items():
        name = path.relative_to(root).as_posix()
        module = importlib.import_module(name[:-3].replace("/", ".").removesuffix(".__init__"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in ours:
                found.add((name, node.attr))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                found |= {(name, part) for part in node.module.split(".") if private(part)}
                found |= {(name, alias.name) for alias in node.names if private(alias.name)}
            elif isinstance(node, ast.ClassDef):
                cls = getattr(module, node.name, None)
                if not inspect.isclass(cls):
                    continue
                third_party = [base for base in cls.__mro__[1:] if not base.__module__.startswith(package)]
                for method in node.body:
                    if (
                        isinstance(method, ast.FunctionDef)
                        and private(method.name)
                        and any(method.name in vars(base) for base in third_party)
                    ):
                        found.add((name, method.name))
    return found


def test_no_third_party_underscore_names_outside_the_allow_list():
    found = underscore_uses()
    assert sorted(found - ALLOWED.keys()) == []
    assert sorted(ALLOWED.keys() - found) == []  # an entry the code no longer needs goes


def test_the_scan_finds_reads_imports_and_overrides(tmp_path, monkeypatch):
    """The three forms, in a stand-in package: a read, an import from a private module, an override; a name
    the package defines itself is its own."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "__init__.py").write_text(
        "import torch\nfrom torch._dynamo import exc\nfrom lightning.pytorch.cli import LightningCLI\n"
        "x = torch._C\n\nclass CLI(LightningCLI):\n    def _parse_ckpt_path(self):\n        self._own = 1\n"
        "        return self._own\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert underscore_uses(tmp_path, "probe") == {
        ("probe/__init__.py", "_dynamo"),
        ("probe/__init__.py", "_C"),
        ("probe/__init__.py", "_parse_ckpt_path"),
    }
