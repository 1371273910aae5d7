"""``specfit plan``: from a device-memory budget to the best setting, by running a sweep.

The memory model (bytes on the device, batch size 1):

    device = dense weights + KV cache + expert slots + staging + drafter + workspace + reserve
    dense weights = every parameter but the routed experts (embeddings, attention, norms,
                    routers, lm_head) x dtype bytes
    KV cache      = layers x kv_heads x head_dim x 2 (K and V) x (context + tree tokens) x dtype bytes
    expert slots  = cached experts per layer x layers x bytes of one expert
    staging       = two experts' buffers while not every expert is cached (the runtime streams the
                    overflow of a layer's union through them, :mod:`specfit.runtime.offload`)
    drafter       = a policy that drafts: the stand-in EAGLE-3 head's weights (the target's
                    embedding shared) and its KV cache for the context
                    (:func:`~specfit.runtime.footprint.drafter_footprint`)
    workspace     = the largest pass's transient tensors: the prompt's largest pass, a chunk of
                    ``prefill chunk`` tokens over ``prompt tokens`` (the target's, and the
                    drafter's for a policy that drafts: attention scores [heads, chunk, prompt],
                    about 8 bytes each in bfloat16; ``specfit decode`` runs the prompt in such
                    chunks, :mod:`specfit.runtime.prefill`) or the verification of
                    the tree over the context (:func:`~specfit.runtime.footprint.pass_workspace_bytes`:
                    the runtime's own modules run on the meta device)
    reserve       = what the estimate leaves out: the CUDA context, the caching allocator's
                    rounding, the MLP blocks' activations

``tree tokens`` is the largest tree a policy verifies (its KV entries are written before the
accepted path is compacted). The cache sizes tried run from none to the most the budget holds
(``cache_steps`` steps); the candidate policies are AR, chains, fixed rerank trees
(``static:N``), EAGLE-3 trees of several widths and depths and ``specfit`` with several level
caps. Every (policy, cache size) is one cell per trace; a setting's throughput over several traces
is their total committed tokens over their total time, and the best setting is the fastest,
the one using less memory on a tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import SpecFitError, comma_list
from ..runtime.prefill import PREFILL_CHUNK, check_prefill_chunk
from .dataset import PLAN_FILE

__all__ = ["MemoryBudget", "MemoryModel", "dense_weight_params", "kv_bytes_per_token", "tree_tokens",
           "DEFAULT_CANDIDATES", "cache_sizes", "rank_settings", "PlanResult", "run_plan", "PLAN_FILE"]

PLAN_MAX_LEVELS = 8             # the draft levels the plan's sweep caps specfit and static:N at (the grid's default)
DEFAULT_CANDIDATES = ("ar", "chain:1", "chain:2", "chain:3", "chain:4", "static:2", "static:3", "static:4", "static:8",
                      "eagle3:8:3", "eagle3:16:4", "eagle3:32:5", "eagle3:60:8", "specfit:4", "specfit:8")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MemoryBudget:
    device_bytes: float
    context_tokens: int = 4096
    reserve_bytes: float = 1e9
    dtype: str = "bfloat16"
    prompt_tokens: int | None = None     # the longest prompt; None: the context's length
    prefill_chunk: int = PREFILL_CHUNK   # the prompt's passes, as decode runs them (0: one pass)

    def __post_init__(self) -> None:
        check_prefill_chunk(self.prefill_chunk)
        if not 0 < self.device_bytes < math.inf:
            raise SpecFitError(f"--device-memory-gb: expected a positive, finite size, got {self.device_bytes / 1e9:g}")
        if self.context_tokens < 1:
            raise SpecFitError(f"--context-tokens: expected >= 1, got {self.context_tokens}")
        if self.prompt_tokens is not None and not 1 <= self.prompt_tokens <= self.context_tokens:
            raise SpecFitError(f"--prompt-tokens: expected 1..{self.context_tokens} (--context-tokens, which holds the "
                               f"prompt and what is generated), got {self.prompt_tokens}")
        if not self.reserve_bytes >= 0:
            raise SpecFitError(f"--reserve-gb: expected >= 0, got {self.reserve_bytes / 1e9:g}")
        if self.dtype not in _DTYPE_BYTES:
            raise SpecFitError(f"--dtype: expected one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def longest_prompt(self) -> int:
        return self.context_tokens if self.prompt_tokens is None else self.prompt_tokens


def dense_weight_params(config) -> int:
    """Parameters of everything but the routed experts of a :class:`~specfit.runtime.config.ModelConfig`:
    what the runtime's model holds on the device (attention of any kind, norms, routers, shared
    experts and dense MLP layers, embeddings), counted on a model built on the meta device; a tied
    ``lm_head`` is the embedding, held once (the loader)."""
    params = sum(t.numel() for t in _meta_model(config).state_dict().values())
    return params - (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes in every layer, as the runtime's attention allocates them
    (full keys and values; MLA's compressed latents)."""
    import torch

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    caches = [layer.self_attn.make_kv_cache(1, dtype, "meta") for layer in _meta_model(config).layers]
    return sum(t.nbytes for cache in caches for t in cache.buffers())


def _meta_model(config):
    import torch

    from ..runtime.model import MoETransformer

    with torch.device("meta"):
        return MoETransformer(config)


def tree_tokens(policy: str, max_nodes_by_levels: np.ndarray) -> int:
    """The most nodes (root included) ``policy`` verifies in a cycle, within the levels it drafts
    (a replay drafts no deeper than the traces); ``max_nodes_by_levels[d]``: the largest tree
    within d levels on the traces."""
    from ..policies import ChainPolicy, RerankPolicy, make_policy

    built = make_policy(policy, PLAN_MAX_LEVELS)          # levers change no tree size
    levels = min(built.max_levels, len(max_nodes_by_levels) - 1)
    if isinstance(built, ChainPolicy):
        return levels + 1
    largest = int(max_nodes_by_levels[levels])
    return min(built.total_nodes, largest) if isinstance(built, RerankPolicy) else largest


@dataclass(frozen=True)
class MemoryModel:
    model: str
    config: object            # ModelConfig
    budget: MemoryBudget

    @property
    def dense_bytes(self) -> int:
        config = self.config
        routers = 0
        if config.router_float32:          # DeepSeek's routers stay in float32 whatever --dtype (the loader)
            routers = config.n_moe_layers * config.n_experts * config.hidden_size * (4 - self.budget.dtype_bytes)
        return dense_weight_params(config) * self.budget.dtype_bytes + routers

    @property
    def expert_bytes(self) -> int:
        return self.config.expert_params * self.budget.dtype_bytes

    @property
    def slot_bytes(self) -> int:
        """One more cached expert in every MoE layer."""
        return self.config.n_moe_layers * self.expert_bytes

    def kv_bytes(self, tree: int) -> int:
        return kv_bytes_per_token(self.config, self.budget.dtype_bytes) * (self.budget.context_tokens + tree)

    def staging_bytes(self, cache_experts: int) -> int:
        from ..experts.cache import ExpertCache

        return ExpertCache.staging_buffers(cache_experts, self.config.n_experts) * self.expert_bytes

    @cached_property
    def _drafter(self):
        from ..runtime.footprint import drafter_footprint

        return drafter_footprint(self.config, self._torch_dtype, self.budget.context_tokens, self.budget.longest_prompt,
                                 self.budget.prefill_chunk)

    @property
    def _torch_dtype(self):
        import torch

        return getattr(torch, self.budget.dtype)

    def drafter_bytes(self, tree: int) -> int:
        """The drafter's weights and KV cache for a policy verifying trees of ``tree`` tokens (1:
        the root alone, ``ar``, which loads no drafter)."""
        return 0 if tree <= 1 else self._drafter.weight_bytes + self._drafter.kv_bytes

    @property
    def prompt_chunk(self) -> int:
        """Tokens of the prompt's largest pass: a chunk, or the whole prompt within one."""
        from ..runtime.prefill import largest_prompt_pass

        return largest_prompt_pass(self.budget.longest_prompt, self.budget.prefill_chunk)[0]

    @cached_property
    def prompt_pass_bytes(self) -> int:
        """The target's largest pass over the longest prompt (its last row's logits): a chunk over
        the tokens before it, the last full one (a bound where the last chunk is ragged)."""
        from ..runtime.footprint import pass_workspace_bytes
        from ..runtime.prefill import largest_prompt_pass

        new, cached = largest_prompt_pass(self.budget.longest_prompt, self.budget.prefill_chunk)
        return pass_workspace_bytes(self.config, self._torch_dtype, new, cached, logits_rows=1)

    @cached_property
    def _verify_bytes(self) -> dict:
        return {}              # tree tokens -> the verification pass's workspace

    def workspace_bytes(self, tree: int) -> int:
        """The largest pass's transient tensors: the prompt's (and the drafter's over it, for a
        policy that drafts) or the verification of ``tree`` tokens over the context."""
        from ..runtime.footprint import pass_workspace_bytes

        if tree > 1 and tree not in self._verify_bytes:
            self._verify_bytes[tree] = pass_workspace_bytes(self.config, self._torch_dtype, tree,
                                                            self.budget.context_tokens)
        verify = self._verify_bytes.get(tree, 0)
        drafter = 0 if tree <= 1 else self._drafter.prompt_pass_bytes
        return max(self.prompt_pass_bytes, verify, drafter)

    def device_bytes(self, cache_experts: int, tree: int) -> float:
        return (self.dense_bytes + self.kv_bytes(tree) + cache_experts * self.slot_bytes
                + self.staging_bytes(cache_experts) + self.drafter_bytes(tree) + self.workspace_bytes(tree)
                + self.budget.reserve_bytes)

    def max_cache_experts_for(self, tree: int) -> int:
        """The most cached experts per layer that fit (``n_experts`` at most); an error when even
        none fit."""
        left = self.budget.device_bytes - self.device_bytes(0, tree)
        if left < 0:
            need = self.device_bytes(0, tree)
            raise SpecFitError(
                f"--device-memory-gb {self.budget.device_bytes / 1e9:g}: {self.model} needs {need / 1e9:.2f} GB with no "
                f"cached expert (dense weights {self.dense_bytes / 1e9:.2f} GB, KV cache {self.kv_bytes(tree) / 1e9:.2f} "
                f"GB, staging {self.staging_bytes(0) / 1e9:.3f} GB, drafter {self.drafter_bytes(tree) / 1e9:.2f} GB, "
                f"workspace {self.workspace_bytes(tree) / 1e9:.2f} GB with a {self.budget.longest_prompt}-token prompt "
                f"(--prompt-tokens), reserve {self.budget.reserve_bytes / 1e9:.2f} GB)")
        E = self.config.n_experts
        if self.device_bytes(E, tree) <= self.budget.device_bytes:
            return E
        return int(min(E - 1, (self.budget.device_bytes - self.device_bytes(0, tree)) // self.slot_bytes))

    def to_dict(self) -> dict:
        return {"model": self.model, "device_bytes": self.budget.device_bytes, "context_tokens": self.budget.context_tokens,
                "prompt_tokens": self.budget.longest_prompt, "prefill_chunk": self.budget.prefill_chunk,
                "drafter_bytes": self.drafter_bytes(2),
                "prompt_pass_bytes": self.prompt_pass_bytes,
                "reserve_bytes": self.budget.reserve_bytes, "dtype": self.budget.dtype, "dense_bytes": self.dense_bytes,
                "expert_bytes": self.expert_bytes, "slot_bytes": self.slot_bytes,
                "kv_bytes_per_token": kv_bytes_per_token(self.config, self.budget.dtype_bytes)}


def cache_sizes(max_cache: int, steps: int) -> list[int]:
    """None, the most that fits, and ``steps - 1`` evenly spaced sizes between."""
    if steps < 1:
        raise SpecFitError(f"--cache-steps: expected >= 1, got {steps}")
    return sorted({int(round(max_cache * i / steps)) for i in range(steps + 1)})


def rank_settings(results: pd.DataFrame, memory: MemoryModel, max_nodes_by_levels: np.ndarray,
                  policies: list[str]) -> pd.DataFrame:
    """One row per (policy, cache size) over every trace (total tokens / total time), with its
    device memory, fastest first (less memory, then candidate order, on a tie)."""
    g = results.groupby(["policy", "cache_experts"], sort=False)[["tokens", "time_s"]].sum().reset_index()
    g["tokens_per_s"] = g["tokens"] / g["time_s"]
    from ..accounting import with_speedups

    g = with_speedups(g, ["cache_experts"], bases=("ar",))
    g["tree_tokens"] = [tree_tokens(p, max_nodes_by_levels) for p in g["policy"]]
    g["expert_cache_bytes"] = g["cache_experts"] * memory.slot_bytes
    g["kv_bytes"] = [memory.kv_bytes(t) for t in g["tree_tokens"]]
    g["drafter_bytes"] = [memory.drafter_bytes(t) for t in g["tree_tokens"]]
    g["workspace_bytes"] = [memory.workspace_bytes(t) for t in g["tree_tokens"]]
    g["device_bytes"] = [memory.device_bytes(c, t) for c, t in zip(g["cache_experts"], g["tree_tokens"])]
    g["candidate"] = g["policy"].map({p: i for i, p in enumerate(policies)})
    g = g.sort_values(["tokens_per_s", "device_bytes", "candidate"], ascending=[False, True, True], kind="stable")
    return g.drop(columns="candidate").reset_index(drop=True)


@dataclass
class PlanResult:
    memory: MemoryModel
    traces: list[str]
    profile: str
    ranked: pd.DataFrame
    out_dir: Path
    cache_sizes: list = field(default_factory=list)   # cached experts per layer tried
    run: object = None
    cells: int = 0
    notes: list = field(default_factory=list)        # the policies a trace is too shallow to replay whole

    @property
    def best(self) -> dict:
        return self.ranked.iloc[0].to_dict()

    def to_dict(self, top: int = 5) -> dict:
        rows = self.ranked.to_dict(orient="records")
        clean = [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in rows]
        return {"memory": self.memory.to_dict(), "traces": self.traces, "profile": self.profile,
                "cache_sizes": self.cache_sizes, "cells": self.cells, "sweep": str(self.out_dir),
                "best": clean[0], "runners_up": clean[1:top + 1], "settings": clean, "notes": self.notes}


def _model_config(model_shape: str | None, trace_model: dict | None):
    from ..calibrate.standin import SHAPE_CONFIGS, shape_config
    from ..runtime.config import ModelConfig

    name = model_shape or (trace_model or {}).get("name")
    if name is None:
        raise SpecFitError("plan: expected --model-shape or --trace")
    if name.endswith(".json"):
        return Path(name).stem, ModelConfig.from_file(name)
    if name not in SHAPE_CONFIGS:
        whose = f"--model-shape {name!r}" if model_shape else f"--model-shape: the trace's model {name!r}"
        raise SpecFitError(f"{whose} has no known config; expected one of "
                           f"{', '.join(k for k in SHAPE_CONFIGS if k != 'tiny')} or a config.json")
    return name, shape_config(name)


def _check_trace_matches(trace, config, dtype_bytes: int, path) -> None:
    m = trace.model
    expected = (config.n_moe_layers, config.n_experts, config.top_k, config.expert_params * dtype_bytes)
    got = (m["n_layers"], m["n_experts"], m["top_k"], m["expert_bytes"])
    if expected != got:
        raise SpecFitError(f"{path}: the trace's model (layers, experts, top-k, expert bytes) {got} differs from "
                           f"--model-shape / --dtype {expected}")


def _max_nodes_by_levels(traces: list) -> np.ndarray:
    """[d]: the largest tree within d draft levels, over every cycle of every trace."""
    deepest = max(int(t.depth.max()) for t in traces)
    out = np.zeros(deepest + 1, dtype=np.int64)
    for t in traces:
        cycle = t.cycle_of_node
        for d in range(deepest + 1):
            out[d] = max(out[d], int(np.bincount(cycle[t.depth <= d], minlength=t.n_cycles).max()))
    return out


def run_plan(budget: MemoryBudget, model_shape: str | None, traces: list[Path], workloads: list[str], tokens: int,
             profile: str, h2d_scale: float = 1.0, rescale: bool = False, policies: str | None = None,
             cache_steps: int = 4, predictor: str = "oracle", out_dir: Path | None = None, address: str | None = None,
             num_cpus: int | None = None, show_progress: bool = True, ctx=None, on_out_dir=None) -> PlanResult:
    """Build the candidate grid for ``budget``, run it as a sweep into ``out_dir`` and rank it.
    ``on_out_dir(path)`` hears the directory as soon as it is known (the default is named after
    the traces' model), so a caller stopped later can say what it kept."""
    from rich.console import Console

    from ..calibrate.presets import resolve_profile
    from ..io import write_json_atomic
    from ..runinfo import check_run_dir
    from ..traces.format import read_trace
    from .commands import deeper_than, depth_note, distinct, distinct_files
    from .dataset import read_results
    from .distributed import execute, ray_session
    from .grid import check_axis_values, parse_spec
    from .scenarios import check_replay_options, scenario_label

    if not traces and model_shape is None:
        raise SpecFitError("plan: expected --trace (your workloads' traces) or --model-shape (traces are synthesised)")
    loaded = [read_trace(p, weights=False) for p in distinct_files("--trace", traces)]
    name, config = _model_config(model_shape, loaded[0].model if loaded else None)
    memory = MemoryModel(name, config, budget)
    out_dir = Path(out_dir) if out_dir is not None else Path("runs") / f"plan-{name}-{budget.device_bytes / 1e9:g}gb"
    if on_out_dir is not None:
        on_out_dir(out_dir)
    candidates = (distinct("--policies", comma_list(policies, "--policies", "policy")) if policies
                  else list(DEFAULT_CANDIDATES))
    if "ar" not in candidates:
        candidates.insert(0, "ar")      # every setting is compared with AR at its cache size
    _check_candidates(candidates)
    check_replay_options(predictor, "calibrated", "per_layer", "lru", weights=False)
    # every input is checked before Ray starts and anything is written: a budget that holds no
    # model, the traces' model, the synthesis options, the cache steps, the profile
    memory.max_cache_experts_for(1)
    for trace, path in zip(loaded, traces):
        _check_trace_matches(trace, config, budget.dtype_bytes, path)
    if not loaded:
        _check_synthesis(name, workloads, tokens, given=model_shape)
        _check_synthesised_dtype(name, config, budget)
    cache_sizes(1, cache_steps)
    check_axis_values({"h2d_scale": [h2d_scale]}, "plan")
    # the profile against every trace's shape (those to synthesise: their preset's), before any is made
    from ..calibrate.profile import ModelShape
    from ..traces.synth import MODEL_SHAPES

    for meta in [t.model for t in loaded] or [MODEL_SHAPES[name]]:
        resolve_profile(profile, ModelShape.from_trace_meta(meta), rescale=rescale)
    check_run_dir(out_dir, "sweep")
    # the last plan's recommendation goes now: a rerun stopped before its own never leaves it
    # beside a sweep run for another budget
    (out_dir / PLAN_FILE).unlink(missing_ok=True)
    with ray_session(address, num_cpus) as ray:
        if not loaded:
            traces, loaded = _synthesised_traces(ray, name, workloads, tokens, out_dir / "traces")
        by_levels = _max_nodes_by_levels(loaded)
        # the pre-check fitted AR's one-token tree; a larger tree's KV entries may not fit the budget
        candidates, too_large = _fitting_candidates(candidates, memory, by_levels)
        notes, shallow = [], set()
        if too_large:
            notes.append(too_large)
            Console(stderr=True).print(too_large, markup=False, highlight=False)
        for trace, path in zip(loaded, traces):
            depth = int(trace.depth.max())
            deeper = deeper_than(candidates, PLAN_MAX_LEVELS, depth, trace)
            if deeper:            # the setting it recommends may be one of them: marked in the ranking
                notes.append(depth_note(deeper, depth, path))
                Console(stderr=True).print(notes[-1], markup=False, highlight=False)
                shallow.update(deeper)
        largest_tree = max(tree_tokens(p, by_levels) for p in candidates)
        sizes = cache_sizes(memory.max_cache_experts_for(largest_tree), cache_steps)
        raw = {"traces": [str(Path(p).resolve()) for p in traces], "profiles": [str(Path(profile).resolve())
                                                                              if profile.endswith(".json") else profile],
               "h2d_scale": [h2d_scale], "cache_experts": sizes, "policies": candidates, "predictor": [predictor],
               "rescale": rescale}
        spec = parse_spec(raw, source="plan")
        run = execute(spec, out_dir, show_progress=show_progress, ctx=ctx,
                      extra={"plan": {**memory.to_dict(), "cache_sizes": sizes, "candidates": candidates}})
    results = read_results(out_dir)
    ranked = rank_settings(results, memory, by_levels, candidates)
    ranked["deeper_than_traces"] = ranked["policy"].isin(shallow)
    label = scenario_label(profile, h2d_scale, {})
    result = PlanResult(memory=memory, traces=sorted(results["trace"].unique()), profile=label, ranked=ranked,
                        out_dir=out_dir, cache_sizes=sizes, run=run, cells=len(results), notes=notes)
    write_json_atomic(out_dir / PLAN_FILE, result.to_dict())
    return result


def _fitting_candidates(candidates: list[str], memory: MemoryModel, by_levels: np.ndarray) -> tuple[list[str], str]:
    """The candidates whose largest tree on the traces fits the budget with no cached expert (AR's
    always does: checked before the traces are made), and a note naming those left out."""
    needs = {p: memory.device_bytes(0, tree_tokens(p, by_levels)) for p in candidates}
    left_out = [p for p in candidates if needs[p] > memory.budget.device_bytes]
    if not left_out:
        return candidates, ""
    what = ", ".join(f"{p} (a tree of {tree_tokens(p, by_levels)} tokens: {needs[p] / 1e9:.2f} GB)" for p in left_out)
    return [p for p in candidates if p not in left_out], (
        f"note: --device-memory-gb {memory.budget.device_bytes / 1e9:g}: left out {what}: the KV cache of "
        f"{memory.model} for its largest tree does not fit with no cached expert")


def _check_candidates(candidates: list[str]) -> None:
    from ..policies import make_policy
    from .sweep import check_policies

    check_policies(candidates, PLAN_MAX_LEVELS)
    replay_only = [p for p in candidates if make_policy(p, max_levels=PLAN_MAX_LEVELS).simulator_only]
    if replay_only:
        raise SpecFitError(f"--policies: {replay_only} run only in a replay (simulator baselines, or the oracle that "
                           "knows the target's verdicts), not settings to deploy; name the policy a decode runs (ar, "
                           "chain:K, eagle3:N:D, static:N, sequoia:N, specfit)")


def _synthesis_options(workload: str, tokens: int) -> dict:
    """Two sequences (the calibrated acceptance and fitted predictors are cross-fitted on the other
    one), trees as deep as the deepest candidate drafts (the preset's 7 levels would replay
    ``eagle3:60:8`` and ``specfit:8`` a level short)."""
    from ..traces.synth import with_drafter_overrides

    return {"seed": 0, "sequence_tokens": max(2, -(-tokens // 2)),
            "drafter": with_drafter_overrides(workload, depth=PLAN_MAX_LEVELS)}


def _synth_task(shape: str, workload: str, tokens: int):
    from ..traces.synth import synthesize

    return synthesize(shape, workload, tokens, **_synthesis_options(workload, tokens))


def _check_synthesis(shape: str, workloads: list[str], tokens: int, given: str | None = None) -> None:
    """The options :func:`_synthesised_traces` takes, checked before any Ray task runs (``given``:
    the --model-shape as the user wrote it, e.g. a config.json)."""
    from ..traces.synth import MODEL_SHAPES, WORKLOADS

    if shape not in MODEL_SHAPES:
        raise SpecFitError(f"--model-shape {given or shape}: traces can be synthesised only for the shapes "
                           f"{sorted(MODEL_SHAPES)}; for another model give --trace (a trace of its routing)")
    from .commands import distinct

    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise SpecFitError(f"--workload: expected presets of {sorted(WORKLOADS)}, got {workloads}")
    distinct("--workload", workloads)       # one trace each: a preset twice would be one file twice
    if tokens < 1:
        raise SpecFitError(f"--tokens: expected >= 1 positions per workload to synthesise, got {tokens}")


def _check_synthesised_dtype(shape: str, config, budget: MemoryBudget) -> None:
    """The synthesised traces carry the preset's expert size (bfloat16 weights), which the replay
    charges each miss for: another ``--dtype`` would size the cache for one expert and move another."""
    from ..traces.synth import MODEL_SHAPES

    synthesised, wanted = MODEL_SHAPES[shape]["expert_bytes"], config.expert_params * budget.dtype_bytes
    if synthesised != wanted:
        raise SpecFitError(f"--dtype {budget.dtype}: experts of {wanted} bytes, but the traces synthesised for {shape} "
                           f"move experts of {synthesised} bytes (bfloat16); give --trace (recorded at "
                           f"{budget.dtype}) or a 2-byte --dtype")


def _synthesised_traces(ray, shape: str, workloads: list[str], tokens: int, folder: Path):
    """Traces of ``shape`` for each workload preset (options checked by :func:`_check_synthesis`),
    synthesised in parallel on Ray once and kept in the plan's directory (a rerun reuses those made
    as they would be made now: the presets are the code's, and may have changed since)."""
    import typer

    from ..traces.format import read_trace, write_trace
    from ..traces.synth import synthesis_record

    paths = [folder / f"{shape}-{w}-{tokens}.parquet" for w in workloads]
    kept = {}
    for w, p in zip(workloads, paths):
        if p.is_file():
            trace = read_trace(p, weights=False)
            if _made_as(trace.meta, synthesis_record(shape, w, **_synthesis_options(w, tokens))):
                kept[p] = trace
            else:
                typer.secho(f"plan: {p} was synthesised with other settings than the {w!r} preset's now; "
                            "synthesising it again", err=True)
    remote = ray.remote(_synth_task)
    todo = {remote.remote(shape, w, tokens): p for w, p in zip(workloads, paths) if p not in kept}
    for ref, path in todo.items():
        write_trace(ray.get(ref), path)
    return paths, [kept[p] if p in kept else read_trace(p, weights=False) for p in paths]


def _made_as(meta: dict, record: dict) -> bool:
    """Whether a synthetic trace's metadata holds ``record`` (its ``parameters`` also hold what was fitted)."""
    parameters = meta.get("parameters") if isinstance(meta.get("parameters"), dict) else {}
    made = {**meta, "parameters": {k: parameters.get(k) for k in record["parameters"]}}
    return all(made.get(k) == v for k, v in record.items())
