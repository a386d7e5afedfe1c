"""What the store's decisions measure once per model and device, cached on disk: Pensieve's Cost(l) and the
device -> host bandwidth (`cost.py`), HCache's per-layer costs for the hidden-state layer split (`hidden.py`).
Import the module you need (`stateful_hf.profile.cost`): the package itself imports nothing."""
