"""Benchmarks: ``serve`` drives an OpenAI-compatible server with a reproducible workload."""
