"""What every benchmark shares: models built offline or a named real model (`models.py`), the thread state every
system starts from (`threads.py`), the neighbour processes a benchmark runs beside (`neighbours.py`) and the
closed loop of multi-turn sessions (`closed_loop.py`). Each `python -m benchmarks.<name>` imports from here."""
