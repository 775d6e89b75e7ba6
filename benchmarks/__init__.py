"""Benchmarks for rewritec: eager PyTorch vs Inductor vs rewritec, measured in one process.

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--cases a,b]

`benchmarks.cases` defines the workloads; `benchmarks.run` measures them and writes
`benchmarks/results/<device>.md` and `<device>.json`. See `benchmarks/README.md`.
"""
