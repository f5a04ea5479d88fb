"""The vLLM generation actor: one engine, sampling with per-request seeds, and refit on request.

`VllmGenerator` is a plain class; GeneratorGroup turns it into Ray actors. One instance holds one
vLLM engine whose engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
  cpu   distributed_executor_backend="uni", eager (`vllm.enforce_eager` auto), a small
        kv_cache_memory_bytes: starts in seconds, ~1 GB, and the worker runs in this process, so
        refit buckets reach it by reference.
  cuda  the same class with tensor_parallel_size=tensor_parallel and CUDA graphs (`vllm.enforce_eager`
        auto; every refit writes in place, so they stay valid). TP 1: "uni" (the worker in this
        process, on the GPU the actor holds). TP > 1: vLLM 0.32's default Ray executor,
        RayExecutorV2, pinned (`executor_class`, `engine_env`): its workers may span nodes (the
        reference recipe: one engine, TP 8 on two nodes), take one GPU bundle each of the
        placement group the actor was started in (launcher.plan.engine_bundles), see every GPU of
        their node (no per-actor CUDA_VISIBLE_DEVICES; vLLM maps local ranks to the bundles' GPUs)
        and get their calls through a shared-memory / TCP message queue. Its own ranking of the
        bundles (the actor's node first, then the others by Ray node id) would not be the plan's
        beyond two nodes; VLLM_RAY_BUNDLE_INDICES = 0..TP-1 makes worker rank r the one in bundle r,
        which the plan pins to tp_rank r's node. Written for GPUs, not runnable on this machine.

Sampling: every request gets its own SamplingParams(seed=...), so what a request samples does
not depend on the batch it shares or the engine's history. The returned logprobs are the
engine's logprobs of the sampled tokens (vLLM `logprobs=0`); `logprobs_mode` picks raw (the
model's distribution, what the trainer computes; default) or processed (after temperature/top-p).

Refit: `apply_refit` passes the payload to every vLLM worker (`workers.refit.vllm_extension`), then, in
adapter mode, registers the new adapter under a new id, and always resets the prefix cache: a
cached prefix holds keys/values computed with the old weights, and reusing them after a refit
gives wrong tokens for any prompt longer than one block.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from launcher.config.schema import GenerationRole, Topology, Vllm
from workers import cpu_shim, hf_checkpoint
from workers.contracts import Generation, GeneratorInfo
from workers.refit.transports import BroadcastTransport, RayTransport

EXTENSION = "workers.refit.vllm_extension.RefitWorkerExtension"
RAY_EXECUTOR = "vllm.v1.executor.ray_executor_v2.RayExecutorV2"  # vLLM 0.32's default for backend "ray"
UNI_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
CPU_BATCHED_TOKENS = 2048   # vLLM's default tokens of one engine step (engine_kwargs: no chunked prefill on CPU)
_GROUP_ONLY_KEYS = ("nodes", "ranks_per_node", "engines")  # topology.generation keys the group uses


@dataclass(kw_only=True)
class GeneratorConfig(Vllm):
    """One engine. Field names are the config keys: `vllm:` (schema.Vllm: the fields and defaults
    inherited from there) and `topology.generation.tensor_parallel`."""

    model: str                                # HF checkpoint directory
    device: str = Topology.device             # the schema's default, as tensor_parallel's
    tensor_parallel: int = GenerationRole.tensor_parallel
    # the engine settings of topology.generation (schema.GenerationRole: their docs and what vLLM accepts)
    attention_backend: str | None = GenerationRole.attention_backend
    moe_backend: str = GenerationRole.moe_backend
    cudagraph_mode: str | None = GenerationRole.cudagraph_mode
    cudagraph_capture_sizes: list[int] | None = GenerationRole.cudagraph_capture_sizes
    fuse_allreduce_rms: bool | None = GenerationRole.fuse_allreduce_rms
    max_num_seqs: int | None = GenerationRole.max_num_seqs
    mamba_ssm_cache_dtype: str = GenerationRole.mamba_ssm_cache_dtype
    enable_lora: bool = False                 # True for refit.mode=adapter
    seed: int = 0
    logprobs_mode: str = "raw_logprobs"       # raw_logprobs | processed_logprobs
    adapter_dir: str | None = None            # node-local dir for adapter refits; None: a temp dir
    worker_extension: str = EXTENSION         # class path vLLM mixes into its workers (refit's receiver)

    @classmethod
    def from_sections(cls, model: str, vllm: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                      *, device: str = "cpu", refit_mode: str = "merged", seed: int = 0) -> "GeneratorConfig":
        """From the plain `vllm:` and `topology.generation:` config sections."""
        known = {f.name for f in fields(cls)}
        values = dict(vllm)
        for key, value in (generation or {}).items():
            if key not in _GROUP_ONLY_KEYS:
                values[key] = value
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"GeneratorConfig: unknown keys {unknown}")
        return cls(model=str(model), device=device, enable_lora=(refit_mode == "adapter"), seed=seed, **values)

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any], model: str, tensor_parallel: int) -> "GeneratorConfig":
        """The engine of a run: the plain run config (dataclasses.asdict of the typed one), its `vllm:` section
        and topology.generation's engine settings, with the plan's `tensor_parallel` (1 on cpu)."""
        return cls.from_sections(model, config["vllm"], {**config["topology"]["generation"],
                                                         "tensor_parallel": tensor_parallel},
                                 device=config["topology"]["device"], refit_mode=config["refit"]["mode"],
                                 seed=config["run"]["seed"])

    def eager(self) -> bool:
        """vllm.enforce_eager resolved: "auto" is eager on cpu and CUDA graphs on cuda. Graphs replay
        kernels on the addresses they captured; refit writes every weight in place (vLLM's layerwise
        reload copies into the original tensors; adapters load into vLLM's LoRA slots), which
        tests/integration/test_generator.py checks tensor by tensor for every mode."""
        if self.enforce_eager == "auto":
            return self.device == "cpu"
        return bool(self.enforce_eager)

    def executor_class(self) -> str:
        """The vLLM executor this engine runs (module.Class): checked by the preflight on every node."""
        return RAY_EXECUTOR if self.device != "cpu" and self.tensor_parallel > 1 else UNI_EXECUTOR

    def engine_env(self) -> dict[str, str]:
        """Environment the engine needs before vLLM is imported (VllmGenerator sets it in its process)."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core in this process (see VllmGenerator)
        if self.executor_class() == RAY_EXECUTOR:
            env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = "1"  # pinned: a site's environment cannot switch to V1
            env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in range(self.tensor_parallel))
        return env

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of vllm.LLM for this config."""
        kw: dict[str, Any] = dict(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                                  enforce_eager=self.eager(), seed=self.seed,
                                  logprobs_mode=self.logprobs_mode, worker_extension_cls=self.worker_extension,
                                  distributed_executor_backend="ray" if self.executor_class() == RAY_EXECUTOR
                                  else "uni")  # "ray": workers may live on other nodes
        if has_mamba_layers(self.model):
            kw["enable_prefix_caching"] = False  # see has_mamba_layers
        if self.device == "cpu":
            # No chunked prefill on CPU: a prompt split over two engine steps makes vLLM rewind the
            # request's seeded generator (gpu_model_runner._bookkeeping_sync: set_offset), which a CPU
            # generator refuses ("CPU Generator does not use offset"). It happens once a step's prompts
            # exceed max_num_batched_tokens (2048): long prompts, or multi-turn episodes' histories.
            # Whole prompts only, then, with a budget of at least one whole prompt.
            kw.update(kv_cache_memory_bytes=self.kv_cache_memory_bytes, enable_chunked_prefill=False,
                      max_num_batched_tokens=max(self.max_model_len, CPU_BATCHED_TOKENS))
        else:
            kw.update(tensor_parallel_size=self.tensor_parallel, gpu_memory_utilization=self.gpu_memory_utilization)
            kw.update(self.cuda_kernel_kwargs())
        if self.max_num_seqs is not None:
            kw["max_num_seqs"] = self.max_num_seqs
        if self.mamba_ssm_cache_dtype != "auto":
            kw["mamba_ssm_cache_dtype"] = self.mamba_ssm_cache_dtype
        if self.enable_lora:
            kw.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
            outside = hf_checkpoint.lora_targets_outside_experts(self.model)
            if outside is not None:
                kw["lora_target_modules"] = outside
        return kw


    def cuda_kernel_kwargs(self) -> dict[str, Any]:
        """What topology.generation pins of the engine's CUDA kernels and graphs (none: vLLM's choice),
        as vllm.LLM takes them; set on cuda only (vLLM CPU has one attention and one MoE path, no graphs)."""
        kw: dict[str, Any] = {}
        if self.attention_backend is not None:
            kw["attention_backend"] = self.attention_backend
        if self.moe_backend != "auto":
            kw["moe_backend"] = self.moe_backend
        compilation: dict[str, Any] = {}
        if self.cudagraph_mode is not None:
            compilation["cudagraph_mode"] = self.cudagraph_mode
        if self.cudagraph_capture_sizes is not None:
            compilation["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        if self.fuse_allreduce_rms is not None:
            compilation["pass_config"] = {"fuse_allreduce_rms": self.fuse_allreduce_rms}
        if compilation:
            kw["compilation_config"] = compilation
        return kw


def has_mamba_layers(model: str) -> bool:
    """Whether the checkpoint at `model` is a hybrid with Mamba layers (its layer pattern, a fact:
    launcher.config.model_facts); False where it has no config.json. Its engine runs without prefix
    caching on every device, as NeMo RL's Nemotron 3 Super recipe does (`enable_prefix_caching:
    false`): with it vLLM keeps a hybrid's Mamba state per block ('align' mode, which needs chunked
    prefill; vllm/model_executor/models/config.py MambaModelConfig) instead of one state per
    sequence, and vLLM CPU crashes on a prefill longer than the Mamba block with it on
    (workers/cpu_shim/vllm.py turns it off for `vllm serve` too). What is given up: the
    generations of one prompt share no prefix blocks (a refit drops the cache every step anyway)."""
    from launcher.config import model_facts

    if not os.path.isfile(os.path.join(model, "config.json")):
        return False
    facts, _ = model_facts.read(model)
    return "M" in str(facts.family_facts.get("hybrid_override_pattern") or "")


class VllmGenerator:
    """One vLLM engine (use as a Ray actor: ray.remote(VllmGenerator).options(...).remote(config))."""

    def __init__(self, config: GeneratorConfig | Mapping[str, Any]):
        if not isinstance(config, GeneratorConfig):
            config = GeneratorConfig(**config)
        if config.device == "cpu" and config.tensor_parallel != 1:
            raise ValueError("vLLM on CPU runs one in-process worker: tensor_parallel must be 1")
        # The engine core runs in this process on every device: collective_rpc then hands refit
        # specs to the executor as Python objects (uni: by reference; RayExecutorV2: pickled into
        # its message queue), never through vLLM's msgpack IPC. Read when vLLM builds the engine.
        os.environ.update(config.engine_env())
        self.config = config
        import psutil

        # (phase, time.time() at its end) for the driver's start-up breakdown
        self.startup = [("Ray worker process start", psutil.Process().create_time()),
                        ("imports (generator module)", time.time())]
        t0 = time.perf_counter()
        from vllm import LLM

        self.startup.append(("import vllm", time.time()))
        cpu_shim.apply_vllm(config.device)  # the engine runs in this process (MoE on vLLM CPU)
        self.llm = LLM(**config.engine_kwargs())
        self.start_seconds = time.perf_counter() - t0
        self.startup.append(("engine up (LLM())", time.time()))
        self._lora_request = None
        self._adapter_id = 0
        self._adapter_root = config.adapter_dir or os.path.join(tempfile.gettempdir(), "vllm_refit_adapters",
                                                                uuid.uuid4().hex[:12])
        self.transport = RayTransport.name

    def info(self) -> GeneratorInfo:
        import socket

        return GeneratorInfo(pid=os.getpid(), hostname=socket.gethostname(), start_seconds=self.start_seconds,
                             startup=self.startup, model=self.config.model, device=self.config.device,
                             enable_lora=self.config.enable_lora, adapter_id=self._adapter_id)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int | Sequence[int] = 16, seeds: Sequence[int] | None = None,
                 ignore_eos: bool = False) -> list[Generation]:
        """Sample one completion per prompt; seeds (one per prompt) make each request reproducible;
        max_tokens: one for all, or one per prompt (a multi-turn episode's budget)."""
        from vllm import SamplingParams

        if seeds is not None and len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
        limits = [max_tokens] * len(prompt_token_ids) if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != len(prompt_token_ids):
            raise ValueError(f"{len(limits)} max_tokens for {len(prompt_token_ids)} prompts")
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=int(limits[i]), logprobs=0,
                                 ignore_eos=ignore_eos, seed=None if seeds is None else int(seeds[i]))
                  for i in range(len(prompt_token_ids))]
        prompts = [{"prompt_token_ids": list(map(int, p))} for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        results = []
        for out in outputs:
            c = out.outputs[0]
            token_ids = list(c.token_ids)
            logprobs = [step[tok].logprob for step, tok in zip(c.logprobs or [], token_ids)]
            results.append(Generation(token_ids, c.text, logprobs, c.finish_reason))
        return results

    # ------------------------------------------------------------------ refit
    def open_refit_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                         timeout_s: float = 600.0) -> list[int]:
        """Join trainer rank 0's broadcast group (every vLLM worker of this engine joins)."""
        ranks = self.llm.collective_rpc("refit_open_group",
                                        args=(host, port, world_size, rank_offset, backend, timeout_s))
        self.transport = BroadcastTransport.name
        return ranks

    def num_workers(self) -> int:
        return self.config.tensor_parallel if self.config.device != "cpu" else 1

    def apply_refit(self, payload) -> dict:
        """Apply one refit (a wire.RefitPayload) to every worker of this engine, then drop the prefix
        cache: its blocks hold keys and values computed with the old weights."""
        t0 = time.perf_counter()
        report = self._apply_refit(payload)
        self.llm.reset_prefix_cache()
        return {**report, "seconds": time.perf_counter() - t0}

    def _apply_refit(self, payload) -> dict:
        t0 = time.perf_counter()
        spec = payload.to_spec()
        if payload.mode == "adapter":
            if not self.config.enable_lora:
                raise RuntimeError("adapter refit needs an engine started with enable_lora (refit.mode=adapter)")
            self._adapter_id += 1
            spec["adapter_dir"] = os.path.join(self._adapter_root, f"v{self._adapter_id}")
        results = self.llm.collective_rpc("refit_apply", args=(spec,))
        if payload.mode == "adapter":
            self._swap_adapter(spec["adapter_dir"])
        elif self._lora_request is not None:  # weights refit on a LoRA engine: serve the new weights
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            self._lora_request = None
        return {"seconds": time.perf_counter() - t0, "bytes": results[0]["bytes"],
                "buckets": results[0]["buckets"], "layouts_fetched": sum(r["layout_received"] for r in results),
                "workers": results}

    def _swap_adapter(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        new = LoRARequest(f"refit-{self._adapter_id}", self._adapter_id, path)
        if self._lora_request is not None:
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
        self.llm.llm_engine.add_lora(new)  # load now: the refit time includes it, errors surface here
        self._lora_request = new

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        del llm
