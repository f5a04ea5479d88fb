"""LatentMoE without Transformer Engine (workers.cpu_shim's `moe_latent_proj`) against transformers.

Nemotron 3 Super/Ultra's MoE layers route tokens to experts that compute in a smaller width
(`moe_latent_size`): fc1_latent_proj (hidden -> latent) before the dispatch, fc2_latent_proj after the
combine, the shared expert on the full width. megatron-core builds the projections as TE linears and
asserts TE; on CPU the shim's LatentLinear stands in. One megatron-core MoELayer (the local layer spec the
trainer uses on CPU: get_moe_module_spec(use_te=False), sigmoid router with an expert bias and a routing
scale, relu2 experts, a shared expert) is given transformers' NemotronHMoE's weights, and both are run on
the same tokens: outputs and the gradients of the input, the projections, the experts, the shared expert
and the router agree in float32. In a fresh interpreter (megatron's parallel state is process-wide).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
from workers import cpu_shim
cpu_shim.apply("cpu")
import torch, transformers
from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer import TransformerConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

_PG = tempfile.TemporaryDirectory(prefix="pg-")  # the rendezvous file: removed when the worker exits
torch.distributed.init_process_group("gloo", init_method=f"file://{_PG.name}/pg", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
H, L, E, K, I, S = 64, 24, 8, 3, 32, 48
hf_cfg = transformers.NemotronHConfig(hidden_size=H, moe_latent_size=L, n_routed_experts=E, num_experts_per_tok=K,
                                      moe_intermediate_size=I, moe_shared_expert_intermediate_size=S,
                                      routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
                                      mlp_hidden_act="relu2", layers_block_type=["moe"])
torch.manual_seed(0)
hf = NemotronHMoE(hf_cfg).float()
with torch.no_grad():
    for name, p in hf.named_parameters():
        p.normal_(0.0, 0.2)
    hf.gate.e_score_correction_bias.normal_(0.0, 0.05)
config = TransformerConfig(
    num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=4 * H, num_moe_experts=E,
    moe_router_topk=K, moe_ffn_hidden_size=I, moe_latent_size=L, moe_shared_expert_intermediate_size=S,
    activation_func=squared_relu, gated_linear_unit=False, add_bias_linear=False, normalization="RMSNorm",
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
    moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_shared_expert_overlap=False, params_dtype=torch.float32,
    use_cpu_initialization=True, perform_initialization=False)
layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=config)   # MoELayer
out = {"latent_classes": [type(layer.fc1_latent_proj).__name__, type(layer.fc2_latent_proj).__name__],
       "applied": "moe_latent_proj" in cpu_shim.APPLIED}
with torch.no_grad():
    layer.router.weight.copy_(hf.gate.weight)
    layer.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    for e in range(E):
        layer.experts.local_experts[e].linear_fc1.weight.copy_(hf.experts.up_proj[e])
        layer.experts.local_experts[e].linear_fc2.weight.copy_(hf.experts.down_proj[e])
    layer.shared_experts.linear_fc1.weight.copy_(hf.shared_experts.up_proj.weight)
    layer.shared_experts.linear_fc2.weight.copy_(hf.shared_experts.down_proj.weight)
    layer.fc1_latent_proj.weight.copy_(hf.fc1_latent_proj.weight)
    layer.fc2_latent_proj.weight.copy_(hf.fc2_latent_proj.weight)
x = torch.randn(2, 7, H)
probe = torch.randn(2, 7, H)
x_hf, x_mg = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
y_hf = hf(x_hf)
y_mg, bias = layer(x_mg)
y_mg = y_mg.transpose(0, 1)
(y_hf * probe).sum().backward()
(y_mg * probe).sum().backward()
experts = layer.experts.local_experts
grads = {
    "input": (x_hf.grad, x_mg.grad.transpose(0, 1)),
    "fc1_latent_proj": (hf.fc1_latent_proj.weight.grad, layer.fc1_latent_proj.weight.grad),
    "fc2_latent_proj": (hf.fc2_latent_proj.weight.grad, layer.fc2_latent_proj.weight.grad),
    "router": (hf.gate.weight.grad, layer.router.weight.grad),
    "shared_fc1": (hf.shared_experts.up_proj.weight.grad, layer.shared_experts.linear_fc1.weight.grad),
    "expert_fc1": (hf.experts.up_proj.grad, torch.stack([e.linear_fc1.weight.grad for e in experts])),
    "expert_fc2": (hf.experts.down_proj.grad, torch.stack([e.linear_fc2.weight.grad for e in experts])),
}
out["bias"] = bias is None
out["shapes"] = [list(layer.experts.local_experts[0].linear_fc1.weight.shape), list(layer.fc1_latent_proj.weight.shape)]
out["output_max_abs"] = float(y_hf.abs().max())
out["output_diff"] = float((y_hf - y_mg).abs().max())
out["grad_diff"] = {k: float((a - b).abs().max() / max(a.abs().max(), 1e-12)) for k, (a, b) in grads.items()}
out["grad_nonzero"] = {k: bool(a.abs().max() > 0) for k, (a, b) in grads.items()}
out["attrs"] = [getattr(layer.fc1_latent_proj.weight, "sequence_parallel", None),
                getattr(layer.fc1_latent_proj.weight, "tensor_model_parallel", None)]
print(json.dumps(out))
"""


def test_latent_moe_stand_in_matches_transformers_values_and_gradients():
    p = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["applied"] and out["latent_classes"] == ["LatentLinear", "LatentLinear"]
    assert out["shapes"] == [[32, 24], [24, 64]]   # the experts compute in the latent width
    assert out["bias"]
    assert out["output_max_abs"] > 0.1 and out["output_diff"] < 1e-6 * out["output_max_abs"], out
    assert all(out["grad_nonzero"].values()), out
    assert max(out["grad_diff"].values()) < 1e-5, out["grad_diff"]
    assert out["attrs"] == [False, False]   # replicated over TP: not a TP shard (summed over TP only with SP)
