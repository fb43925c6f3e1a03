"""benchmarks/: the helpers the benchmark scripts share, tested on the CPU."""
