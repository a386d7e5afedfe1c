"""Audit: the invariants every operation keeps (`integrity.py`) and what the store reports (`stats.py` for the
records, `store_stats.py` for reading them off the parts). Import the module you need."""
