"""Benchmarks, tuners, profilers and device scripts (not shipped in the wheel). See README.md."""
