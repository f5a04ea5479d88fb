"""Tiny model recipes that only tests build (workers.tiny_models.build(..., spec=...)), beside the
built-in ones a run can name (launcher.config.schema.BUILTIN_MODELS, model.builtin).

    RECIPES["tiny_llama_g4"]      # every recipe a test may build, built-in or not
"""

from __future__ import annotations

from launcher.config.schema import BUILTIN_MODELS

TEST_ONLY = {
    # GQA shapes for the adapter exporter: query groups 1 and 4, heads * head_dim != hidden
    "tiny_llama_mqa": dict(family="llama", hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "tiny_llama_g4": dict(family="llama", hidden_size=160, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32),
}
RECIPES = {**BUILTIN_MODELS, **TEST_ONLY}
