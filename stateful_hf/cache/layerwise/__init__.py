"""Layer-wise KV allocation (LayerKV): a step may fill chunks keeping only some layers on the device
(in residue blocks shared by up to f chunks) and the rest on the host, read layer by layer where
they live; when the turn ends they become HOST chunks. A feature: it runs only in a store made with
`layerwise_kv=True`; otherwise the store has no layered part and no module here runs.
"""

from .chunks import LayeredChunks
from .residues import ResidueTable, kept_layers
from .step import LayeredStep, LayerPlacement

__all__ = ["LayerPlacement", "LayeredChunks", "LayeredStep", "ResidueTable", "kept_layers"]
