"""Benchmarks of the supervisor against the real dockerd, each against a baseline from the same run.

Run from the project root: `.venv/bin/python -m bench.run` (see bench/README.md).
"""
