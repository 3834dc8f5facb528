"""Benchmark harness: load generator, side-by-side runs, engine overhead. Not imported by the server."""
