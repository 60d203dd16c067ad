"""What a Python source imports, read from its syntax tree (the layer test and the test-import test)."""

from __future__ import annotations

import ast


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name ``source`` imports, lazy imports inside functions included. ``from a import b``
    gives both ``a`` and ``a.b`` (``b`` may be a module); relative imports are made absolute from ``module``
    (a package's own name when ``is_package``)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names
