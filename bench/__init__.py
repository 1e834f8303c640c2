"""The benchmarks: `make bench` runs `python -m bench.run_all`; each module runs alone as
`python -m bench.NAME` from the repository root (see its docstring), and shares `bench.common`."""
