"""What several test modules share: micro models, the ``mmlight`` subprocess, data writers, references.

Test modules import from here (and from ``tests/conftest.py``'s fixtures), never from another test
module: ``tests/test_test_imports.py`` checks it.
"""
