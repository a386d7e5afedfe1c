"""Hidden states (HCache): chunks moving down from the device kept as per-layer hidden states (smaller
than K/V on MHA models) and rebuilt to K/V layer by layer, through the model's own projections,
when they come back; the layer split is planned per model. A feature: it runs only when the store
captures hidden states (`hidden_states="always"`, or `"auto"` on a model whose K/V is larger than
its hidden states); by default (`"never"`) the store has no hidden tier and no module here runs.
"""

from .partition import HiddenCosts, HiddenPlan, min_hidden_layers, plan_layers, predicted_time
from .states import HiddenCapture, HiddenPool, HiddenRestore, HiddenSpec, Projector, StepHidden
from .tier import HIDDEN_MODES, HiddenTier

__all__ = ["HIDDEN_MODES", "HiddenCapture", "HiddenCosts", "HiddenPlan", "HiddenPool", "HiddenRestore",
           "HiddenSpec", "HiddenTier", "Projector", "StepHidden", "min_hidden_layers", "plan_layers",
           "predicted_time"]
