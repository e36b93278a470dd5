"""hsx benchmarks: `make bench` runs them all (python -m bench)."""
