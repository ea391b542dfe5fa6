"""Benchmarks of inferd: load generator, references, and the runs that compare them."""
