"""`srv bench`: load generation and throughput benchmarks."""
