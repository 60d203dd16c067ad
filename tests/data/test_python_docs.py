"""The Python-docs corpus (mmlight/data/prepare/python_docs.py): its documents against pydoc_data and
docstrings written here, the folders left out, a file that does not parse named, and the shard set."""

from __future__ import annotations

import json
from pydoc_data.topics import topics

import pytest

from mmlight.commands.prepare import main
from mmlight.data.prepare import python_docs
from mmlight.data.shards import read_info

MODULES = {
    "mod.py": '"""Module doc."""\n\n\nclass A:\n    """Class doc."""\n\n    def f(self):\n        """Method doc."""\n',
    "pkg/sub.py": 'async def g():\n    """G doc."""\n',
    "nodoc.py": "x = 1\n",
    "bad.py": "def (:\n",
    "test/test_x.py": '"""Left out."""\n',
    "pkg/tests/t.py": '"""Left out."""\n',
    "idlelib/i.py": '"""Left out."""\n',
    "site-packages/s.py": '"""Left out."""\n',
}


@pytest.fixture
def stdlib(tmp_path):
    root = tmp_path / "stdlib"
    for name, source in MODULES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source, encoding="utf-8")
    return root


def test_the_corpus_is_the_topics_then_the_module_docstrings(stdlib, tmp_path):
    path = tmp_path / "corpus.jsonl"
    skipped = python_docs.write_corpus(path, stdlib)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    expected = [{"id": f"topic:{name}", "text": topics[name]} for name in sorted(topics)]
    expected += [
        {"id": "module:mod", "text": "Module doc.\n\nClass doc.\n\nMethod doc."},
        {"id": "module:pkg.sub", "text": "G doc."},
    ]
    assert records == expected
    assert [(s.path, s.reason.split(":")[0]) for s in skipped] == [(str(stdlib / "bad.py"), "does not parse")]
    before = path.stat().st_mtime_ns
    python_docs.write_corpus(path, stdlib)  # identical: left untouched
    assert path.stat().st_mtime_ns == before


def test_prepare_makes_a_text_shard_set_of_it(stdlib, tmp_path):
    out = tmp_path / "out"
    info = python_docs.prepare(None, out, 1, stdlib=stdlib, vocab_size=300, valid_fraction=0.1)
    assert info == read_info(out)
    assert info["dataset"] == "python-docs" and info["python"].count(".") == 2
    assert info["num_documents"] == len(topics) + 2
    assert info["splits"]["train"]["num_documents"] + info["splits"]["valid"]["num_documents"] == len(topics) + 2
    assert info["num_skipped"] == 1 and len(info["skipped"]) == 1
    assert info["skipped"][0]["path"] == str(stdlib / "bad.py") and list(info["skipped"][0]) == ["path", "reason"]
    assert info["skipped"][0]["reason"].startswith("does not parse: SyntaxError: ")
    assert info["vocab"]["size"] == 300 and (out / "tokenizer.json").is_file()


def test_the_command_takes_the_text_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["python-docs", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--vocab-size" in out and "--valid-fraction" in out


def test_the_worker_count_reaches_the_text_preparer(stdlib, tmp_path, monkeypatch):
    from mmlight.data.prepare import text

    prepare, asked = text.prepare, []

    def recording(paths, out, workers=1, **options):
        asked.append(workers)
        return prepare(paths, out, workers, **options)

    monkeypatch.setattr(text, "prepare", recording)
    python_docs.prepare(None, tmp_path / "out", 3, stdlib=stdlib, vocab_size=300, valid_fraction=0.1)
    python_docs.prepare(None, tmp_path / "default", stdlib=stdlib, vocab_size=300, valid_fraction=0.1)
    assert asked == [3, 1]  # one process unless asked for more


def test_a_modules_docstrings_are_in_source_order_nested_ones_included():
    """A method's docstring comes before a later function's (``ast.walk`` alone would visit it after)."""
    source = b'"""M."""\n\n\nclass A:\n    """A."""\n\n    def f(self):\n        """F."""\n\n\ndef g():\n    """G."""\n'
    assert python_docs.module_text(source) == "M.\n\nA.\n\nF.\n\nG."


def test_without_a_folder_the_running_pythons_standard_library_is_read_and_written_as_utf_8(tmp_path, monkeypatch):
    """``stdlib=None`` reads the folder ``sysconfig`` names; the corpus keeps non-ASCII text as UTF-8."""
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    (stdlib / "cafe.py").write_text('"""Café crème."""\n', encoding="utf-8")
    monkeypatch.setattr(python_docs.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib), "purelib": "elsewhere"})
    assert python_docs.write_corpus(tmp_path / "corpus.jsonl") == []
    lines = (tmp_path / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines[-1] == '{"id": "module:cafe", "text": "Café crème."}'
    assert len(lines) == len(topics) + 1
