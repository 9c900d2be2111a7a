"""kiln's benchmarks, one module per entry point: run them from the repository root as
`python -m bench.NAME` (bench/README.md lists them). Nothing here is part of the installed package."""
