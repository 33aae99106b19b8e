"""`VllmConfig`, the root of the tree, its cross-section rules, and the serve plan.

The cross-section rules are the boundaries ``vllm serve`` enforces (vLLM's
``ServeSubcommand.cmd``): headless excludes API servers, LB modes are exclusive,
``api_server_count`` is derived when null, elastic EP caps it to 1, runtime LoRA updating
needs a single API server, parsers must be registered.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Literal

from pydantic import model_validator

from pkgd.config.fields import section
from pkgd.config.sections import (
    CacheConfig,
    FrontendConfig,
    LBConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    Section,
    SupervisorConfig,
)
from pkgd.config.speculative import SpeculativeConfig, speculative_problems

ServeMode = Literal["single", "multi_api", "headless", "external_lb", "hybrid_lb"]


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """What the supervisor starts, derived from a valid config (never stored in it).

    ``api_server_count`` is the effective count (0 when headless); ``dp_local`` the DP ranks
    whose engine cores run on this node, starting at ``dp_start_rank``.
    """

    mode: ServeMode
    api_server_count: int
    dp_size: int
    dp_local: int
    dp_start_rank: int
    warnings: tuple[str, ...] = ()


class VllmConfig(Section):
    """The whole daemon configuration. Validated once; children get it as JSON."""

    model: ModelConfig = section(ModelConfig, "What to serve and how to load it.")
    parallel: ParallelConfig = section(ParallelConfig, "Parallelism and devices.")
    lb: LBConfig = section(LBConfig, "Data-parallel load balancing.")
    frontend: FrontendConfig = section(FrontendConfig, "OpenAI-compatible API servers.")
    scheduler: SchedulerConfig = section(SchedulerConfig, "Continuous batching.")
    cache: CacheConfig = section(CacheConfig, "Paged KV cache.")
    supervisor: SupervisorConfig = section(SupervisorConfig, "Process supervision.")
    logging: LoggingConfig = section(LoggingConfig, "Logging.")
    speculative: SpeculativeConfig = section(
        SpeculativeConfig,
        "Speculative decoding (n-gram prompt lookup or a draft model).",
        aliases=("--speculative-config", "-sc"),
    )
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters over the base model.")

    @model_validator(mode="after")
    def _boundaries(self) -> VllmConfig:
        """Check the cross-section rules; every broken rule is one line of the error."""
        problems = _boundary_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def serve_plan(self) -> ServePlan:
        """The serve mode and process counts, as ``vllm serve`` chooses them."""
        return _serve_plan(self)

    def digest(self) -> str:
        """Short stable hash of the validated tree (secrets included, never shown)."""
        blob = json.dumps(self.to_json_dict(reveal_secrets=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def to_json_dict(self, *, reveal_secrets: bool = False) -> dict[str, Any]:
        """Plain JSON-able dict; secrets are ``"**********"`` unless ``reveal_secrets``.

        Children receive ``to_json_dict(reveal_secrets=True)`` through a private pipe or
        file, never through argv or the environment.
        """
        data = self.model_dump(mode="json")
        if reveal_secrets:
            data["frontend"]["api_keys"] = [k.get_secret_value() for k in self.frontend.api_keys]
        return data


def _boundary_problems(cfg: VllmConfig) -> list[str]:
    m, p, f, s = cfg.model, cfg.parallel, cfg.frontend, cfg.scheduler
    problems = []
    if m.trust_remote_code:
        problems.append(
            "model.trust_remote_code: true is refused: pkgd never runs code shipped with a "
            "model; use a supported architecture (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE)"
        )
    if f.headless and f.api_server_count:
        problems.append(
            f"frontend.api_server_count: {f.api_server_count} conflicts with "
            "frontend.headless: true (headless runs no API server; leave it null or 0)"
        )
    if p.dp_rank is not None and cfg.lb.mode == "hybrid":
        problems.append(
            "lb.mode: hybrid conflicts with parallel.dp_rank (a DP rank implies the external "
            "LB); the LB modes are mutually exclusive"
        )
    if p.dp_local is not None and p.dp_local > p.dp:
        problems.append(f"parallel.dp_local: {p.dp_local} exceeds parallel.dp: {p.dp}")
    if p.dp_rank is not None and p.dp_rank >= p.dp:
        problems.append(f"parallel.dp_rank: {p.dp_rank} must be below parallel.dp: {p.dp}")
    if p.node_rank >= p.nnodes:
        problems.append(f"parallel.node_rank: {p.node_rank} must be below parallel.nnodes: {p.nnodes}")
    if m.runner == "generate" and m.convert == "embed":
        problems.append(
            "model.convert: embed conflicts with model.runner: generate (an embedding model needs "
            "model.runner: pooling or auto)"
        )
    if f.enable_auto_tool_choice and not f.tool_call_parser:
        problems.append("frontend.enable_auto_tool_choice: true needs frontend.tool_call_parser to be set")
    problems += _unregistered("frontend.tool_call_parser", f.tool_call_parser, "tool")
    problems += _unregistered("frontend.reasoning_parser", f.reasoning_parser, "reasoning")
    if s.max_num_batched_tokens < s.max_num_seqs:
        problems.append(
            f"scheduler.max_num_batched_tokens: {s.max_num_batched_tokens} must be "
            f"at least scheduler.max_num_seqs: {s.max_num_seqs}"
        )
    if s.long_prefill_token_threshold and not s.enable_chunked_prefill:
        problems.append(
            f"scheduler.long_prefill_token_threshold: {s.long_prefill_token_threshold} caps prefill chunks "
            "and needs scheduler.enable_chunked_prefill: true (or set it to 0)"
        )
    problems += speculative_problems(cfg.speculative, tp=p.tp)
    problems += _lora_problems(cfg.lora)
    plan = cfg.serve_plan()
    if f.allow_runtime_lora_updating and plan.api_server_count > 1:
        problems.append(
            f"frontend.allow_runtime_lora_updating: true is refused with {plan.api_server_count} "
            "API servers: runtime LoRA updates cannot be synchronised across API server "
            "processes; set frontend.api_server_count: 1"
        )
    return problems


def _lora_problems(lora: LoRAConfig) -> list[str]:
    problems = []
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        problems.append(f"lora.max_cpu_loras: {lora.max_cpu_loras} must be at least lora.max_loras: {lora.max_loras}")
    names = [m.name for m in lora.lora_modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"lora.lora_modules: the adapter name {dup[0]!r} is given twice")
    if lora.lora_modules and not lora.enable_lora:
        problems.append("lora.lora_modules: serving adapters needs lora.enable_lora: true (--enable-lora)")
    return problems


def _serve_plan(cfg: VllmConfig) -> ServePlan:
    p, f, lb = cfg.parallel, cfg.frontend, cfg.lb
    is_external = lb.mode == "external" or p.dp_rank is not None
    is_hybrid = lb.mode == "hybrid"
    dp_local = p.dp_local if p.dp_local else max(1, p.dp // p.nnodes)
    if p.dp_rank is not None:
        dp_local = 1
    start = p.dp_start_rank
    if start is None:
        start = p.dp_rank if p.dp_rank is not None else p.node_rank * dp_local
    warnings: list[str] = []
    if f.headless:
        count = 0
    elif f.api_server_count is not None:
        count = f.api_server_count
    elif is_external:
        count = 1
    elif is_hybrid:
        count = p.dp_local or 1
    else:
        count = p.dp
    if p.enable_elastic_ep and count > 1:
        warnings.append(
            f"frontend.api_server_count: {count} capped to 1 because parallel.enable_elastic_ep "
            "supports a single API server"
        )
        count = 1
    if p.enable_expert_parallel and p.tp == 1 and p.dp > 1:
        warnings.append(
            "parallel.enable_expert_parallel splits MoE experts across the tensor-parallel group only "
            f"(parallel.tp is 1): each of the {p.dp} data-parallel engines holds every expert"
        )
    if count and not f.uds and not f.api_keys and not _is_loopback(f.host):
        warnings.append(
            f"frontend.host: {f.host} accepts connections from other machines and frontend.api_keys "
            f"is empty, so anyone who reaches port {f.port} can use the API; set frontend.api_keys "
            "(PKGD_FRONTEND__API_KEYS) or listen on 127.0.0.1"
        )
    if count == 0:
        mode: ServeMode = "headless"
    elif is_external:
        mode = "external_lb"
    elif is_hybrid:
        mode = "hybrid_lb"
    elif count > 1:
        mode = "multi_api"
    else:
        mode = "single"
    return ServePlan(mode, count, p.dp, dp_local, start, tuple(warnings))


def _is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (a host name may resolve anywhere)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _unregistered(path: str, name: str | None, kind: Literal["tool", "reasoning"]) -> list[str]:
    if name is None:
        return []
    from pkgd.parsers import registered_names  # light: names only, no parser code

    names = registered_names(kind)
    if name in names:
        return []
    import difflib  # not pkgd.config.errors' did_you_mean: that module imports this one

    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return [f"{path}: {name!r} is not a registered {kind} parser{hint} (registered: {', '.join(sorted(names))})"]


@functools.cache
def default_config() -> VllmConfig:
    """The tree with every field at its default."""
    return VllmConfig()
