"""Runtime data modules never import the preparers: ``mmlight prepare`` builds on the runtime code
(shard writer, vocabularies, tokenisers), not the other way round."""

import ast
from pathlib import Path

import mmlight.data

DATA = Path(mmlight.data.__file__).parent
PREPARE = "mmlight.data.prepare"


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, lazy imports inside functions included
    (``from mmlight.data import prepare`` counts as ``mmlight.data.prepare``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def prepare_imports(source: str) -> list[str]:
    """The modules under ``mmlight.data.prepare`` that ``source`` imports."""
    return sorted(m for m in imported_modules(ast.parse(source)) if m == PREPARE or m.startswith(PREPARE + "."))


def runtime_modules() -> list[Path]:
    return sorted(p for p in DATA.rglob("*.py") if PREPARE.rsplit(".", 1)[1] not in p.relative_to(DATA).parts)


def test_the_check_sees_every_form_of_import():
    assert prepare_imports("import mmlight.data.prepare.iwslt") == ["mmlight.data.prepare.iwslt"]
    assert prepare_imports("def f():\n    from mmlight.data import prepare\n") == ["mmlight.data.prepare"]
    assert "mmlight.data.prepare.wikitext" in prepare_imports("from mmlight.data.prepare.wikitext import load_vocab")
    assert prepare_imports("from mmlight.data.vocab import load_vocab\nimport mmlight.data.preparation") == []


def test_runtime_data_modules_do_not_import_the_preparers():
    modules = runtime_modules()
    names = {p.stem for p in modules}
    assert {"text", "translation", "toy_translation", "digits", "vocab", "tokenizers"} <= names
    assert not any(p.parent.name == "prepare" for p in modules)
    offenders = {}
    for path in modules:
        bad = prepare_imports(path.read_text(encoding="utf-8"))
        if bad:
            offenders[str(path.relative_to(DATA))] = bad
    assert offenders == {}, f"runtime modules import mmlight.data.prepare: {offenders}"
