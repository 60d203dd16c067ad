"""Tests of the benchmark records and their rendering in BENCHMARKS.md."""
