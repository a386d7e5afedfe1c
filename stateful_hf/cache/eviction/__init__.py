"""Eviction: the policies that rank idle chunks for moving down and the cost profile (`policy.py`), the fair
share's walk over tenants (`fair_walk.py`) and the return-gap estimator (`returns.py`). Import the module you need."""
