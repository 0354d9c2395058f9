"""Benchmarks: ``offline`` measures the engine itself on the GPU; ``serve`` drives an
OpenAI-compatible server with a reproducible workload."""
