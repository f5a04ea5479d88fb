"""Nemotron-H stand-ins for the tests that need the family's facts without a published checkpoint.

The published Nemotron-H checkpoints (Nemotron-H-56B-Base-8K, Nemotron 3 Nano and Super), scaled down
from their config.json files, are tests/helpers/published_models.py's.
"""

from __future__ import annotations

# The reference topology's placement smoke (tests/slurm/test_ultra_placement.py) builds no model, but
# validation checks the model's facts against ultra_6n4g: EP16 must divide the experts, the TP8 engine
# the attention heads, train TP2 the KV groups, Mamba heads and groups. The stand-in for Nemotron 3 Ultra
# is the built-in recipe of the released architecture, tiny_nemotron3 (LatentMoE with 16 experts, 8
# attention heads in 2 KV groups, Mamba 8 heads in 2 groups, MTP layers), whose facts divide them all.
ULTRA_STAND_IN = ["model=tiny_nemotron3"]
