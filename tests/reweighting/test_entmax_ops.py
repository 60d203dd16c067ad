"""mmlight without the ``entmax`` package: everything but the three maps that need it imports and
runs, and building one of those names the package (a GPU node given only the wheels it needs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = """
import importlib.abc, json, sys

class NoEntmax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "entmax" or name.startswith("entmax."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoEntmax())
import torch
import mmlight, mmlight.models, mmlight.reweighting
from mmlight.reweighting import build

x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
softmax_error = (build("softmax")(x) - torch.softmax(x, -1)).abs().max().item()
multimax = build("multimax", order=2, backend="reference").double()
r, t = multimax.ranges.detach(), multimax.ts.detach()
relu = torch.relu
# MultiMax's second-order sigma written out (the paper's piecewise form), then softmax
sigma = x + t[0] * relu(r[0] - x) + t[1] * relu(x - r[1]) + t[2] * relu(r[2] - x) ** 2 + t[3] * relu(x - r[3]) ** 2
report = {
    "entmax_imported": "entmax" in sys.modules,
    "softmax_error": softmax_error,
    "multimax_error": (multimax(x) - torch.softmax(sigma, -1)).abs().max().item(),
    "errors": {},
}
for name in ("sparsemax", "entmax15", "alpha_entmax"):
    try:
        build(name)
    except ModuleNotFoundError as error:
        report["errors"][name] = [error.name, str(error)]
print(json.dumps(report))
"""


def test_mmlight_imports_and_builds_without_entmax():
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(done.stdout.splitlines()[-1])
    assert not report["entmax_imported"]
    assert report["softmax_error"] < 1e-12
    assert report["multimax_error"] < 1e-12
    assert set(report["errors"]) == {"sparsemax", "entmax15", "alpha_entmax"}
    for name, (missing, message) in report["errors"].items():
        assert missing == "entmax"
        assert message.startswith(f"{name} needs the 'entmax' package") and "pip install entmax" in message


def test_building_a_map_without_entmax_names_the_package_the_function_and_the_fix(monkeypatch):
    """The same refusal in this process (``entmax`` made unimportable through ``sys.modules``), whole."""
    from mmlight.reweighting import build

    monkeypatch.setitem(sys.modules, "entmax", None)
    for name in ("sparsemax", "entmax15", "alpha_entmax"):
        with pytest.raises(ModuleNotFoundError) as caught:
            build(name)
        assert caught.value.name == "entmax" and isinstance(caught.value.__cause__, ImportError)
        assert str(caught.value) == (
            f"{name} needs the 'entmax' package, which does not import here ({caught.value.__cause__}); "
            "install it with `pip install entmax`"
        )
