"""Multi-turn serving benchmark: `python -m benchmarks.multiturn --help`."""
