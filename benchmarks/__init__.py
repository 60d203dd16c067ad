"""The benchmark scripts, each run as ``python benchmarks/<script>.py`` (BENCHMARKS.md). A package so that
the tests import what they check of them (``from benchmarks import compile_check``); no runtime module
imports it."""
