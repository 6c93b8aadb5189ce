"""Benchmark helpers shared by scripts/bench_*.py: workloads (`datasets`) and run rooflines (`roofline`)."""
