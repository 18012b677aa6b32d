"""Benchmarks of wslb (scripts, not tests: pytest only collects ``tests/``). See README.md."""
