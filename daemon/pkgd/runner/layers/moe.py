"""Mixture-of-experts MLP (sparsely-gated MoE, Shazeer et al., 2017; as in Mixtral, Jiang et al.,
2024, and Qwen3-MoE): a linear router scores E SwiGLU experts per token, the top k are run, and
the output is the sum of their outputs weighted by the routing weights.

Routing (`select_experts`): softmax over all E router logits in float32, top k, then, when
``renormalize``, the k weights divided by their sum. Mixtral always renormalises (the same as a
softmax over the top-k logits); Qwen3-MoE does when the config's ``norm_topk_prob`` is set.

Weights are stacked by expert at load time: ``w13 [E_local, 2 * I_local, H]`` (each expert's
gate rows, then its up rows, HF's ``[out, in]``) and ``w2 [E_local, H, I_local]``; the router
``gate [E, H]`` is whole on every rank.

Tensor parallel over the TP group, as vLLM does it: by default every rank holds every expert
with its intermediate features split (gate/up column-parallel, down row-parallel); with expert
parallelism (`pkgd.runner.distributed.TPGroup.expert_parallel`, ``parallel.enable_expert_parallel``)
rank r holds the E/tp whole experts ``[r*E/tp, (r+1)*E/tp)``. Either way each rank sees every
token (hidden states are replicated in the group), adds what its weights contribute, and one
all-reduce sums the ranks' partial outputs.

The expert computation has two forms with the same arguments and result (up to the order of
float sums): `experts_reference`, a loop over the local experts, each on the tokens routed to it
(transformers' form), and `experts_grouped`, the CPU path: the (token, slot) pairs sorted by
expert, one grouped GEMM (``torch.nn.functional.grouped_mm``) for every expert's gate/up and one
for down over the contiguous groups, and a scatter-add back into token order; no Python loop.
Measured here (64 experts, top 8, H=1024, I=384, one thread, ms, grouped / per-expert reference /
a Python loop per token): float32 1 token 3.5 / 3.7 / 3.3, 8 tokens 21 / 23 / 25, 64 tokens
49 / 50 / 211, 512 tokens 150 / 159 (compute-bound); bfloat16 within ±20% of the reference.
Other processes shared the cores: a few ms of noise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pkgd_kernels as pk
from pkgd.runner.distributed import SINGLE, TPGroup

GROUPED_MM = hasattr(F, "grouped_mm")


def moe_sizes(raw: dict[str, Any], intermediate_size: int) -> tuple[int, int]:
    """``(num_experts, each expert's intermediate size)`` from an HF ``config.json``: 0 experts
    for a dense model. Mixtral names them ``num_local_experts`` and ``intermediate_size``;
    Qwen3-MoE ``num_experts`` (transformers 5 writes ``num_local_experts``) and
    ``moe_intermediate_size``."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    return experts, int(raw.get("moe_intermediate_size") or intermediate_size)


def check_moe_tp_size(raw: dict[str, Any], intermediate_size: int, tp: TPGroup) -> None:
    """Raise `ModelConfigMismatch` (as `FusedMoE` would on each rank) when ``tp`` cannot split
    the experts (expert parallel) or their intermediate features (otherwise)."""
    experts, inter = moe_sizes(raw, intermediate_size)
    if experts and tp.expert_parallel:
        tp.shard(experts, "num_experts (expert parallel)")
    elif experts:
        tp.shard(inter, "the experts' intermediate_size")


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router ``logits [T, E]`` (any float dtype) -> ``(weights [T, k] float32, ids [T, k] int64)``:
    softmax over the E experts in float32, the k largest, divided by their sum when
    ``renormalize`` (module docstring)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(
    h: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """The routed SwiGLU experts, one local expert at a time (the reference of `experts_grouped`).

    Args:
        h: ``[T, H]`` hidden states (float32 / bfloat16 / float16).
        w13: ``[E_local, 2 * I, H]`` gate rows then up rows of each local expert, ``h.dtype``.
        w2: ``[E_local, H, I]`` down projections, ``h.dtype``.
        weights: ``[T, k]`` float32 routing weights; ``ids``: ``[T, k]`` int64 global expert ids.
        first_expert: the global id of local expert 0 (expert parallelism); ids outside
            ``[first_expert, first_expert + E_local)`` contribute nothing here.

    Returns:
        ``[T, H]`` in ``h.dtype``: ``sum_j weights[t, j] * down(silu(gate(h_t)) * up(h_t))`` over
        the slots j whose expert is local, summed in float32.
    """
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids == first_expert + e, as_tuple=True)
        if tok.numel() == 0:
            continue
        act = pk.silu_and_mul_ref(F.linear(h[tok], w13[e]))
        y = F.linear(act, w2[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(h.dtype)


def experts_grouped(
    h: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    kernels=None,
) -> torch.Tensor:
    """`experts_reference` (same arguments and result) as two grouped GEMMs: the ``T * k``
    (token, slot) pairs stable-sorted by expert, the local experts' pairs a contiguous run with
    one group per expert. Needs ``torch.nn.functional.grouped_mm`` (`GROUPED_MM`) and rows of
    ``H`` and ``I`` elements whose byte sizes are multiples of 16 (`FusedMoE.grouped_applies`).
    ``kernels``: the `pkgd_kernels.cpu.CpuKernels` for the SiLU-and-mul, or None."""
    t, k = ids.shape
    e_local = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=first_expert + e_local)
    start = int(counts[:first_expert].sum())
    local = counts[first_expert : first_expert + e_local]
    pairs = order[start : start + int(local.sum())]
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    if pairs.numel() == 0:
        return out.to(h.dtype)
    offs = torch.cumsum(local, 0).to(torch.int32)
    tok = pairs // k
    gate_up = F.grouped_mm(h[tok], w13.transpose(1, 2), offs=offs)  # [P, 2I]
    act = pk.silu_and_mul(gate_up, kernels=kernels)
    y = F.grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [P, H]
    out.index_add_(0, tok, y.float() * weights.reshape(-1)[pairs, None])
    return out.to(h.dtype)


class MoELayer(nn.Module):
    """What the model families see of an MoE MLP, whatever holds its experts: the routing sizes,
    the router ``gate [E, H]`` (`load_router`, `route`), `load_expert` and ``forward(h [T, H]) ->
    [T, H]``. `FusedMoE` holds float experts (tensor parallel); on GGUF blocks kept quantized it
    is `pkgd.runner.layers.quantized.QuantizedMoE`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, *, renormalize: bool, dtype: torch.dtype):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts {num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [T, H]`` -> ``(weights [T, k] float32, ids [T, k] int64)`` (`select_experts`)."""
        return select_experts(F.linear(h, self.gate), self.top_k, self.renormalize)

    def load_router(self, tensor: torch.Tensor) -> None:
        """The router's full ``weight [E, H]``."""
        _check(tensor, self.gate, "router weight")
        self.gate.copy_(tensor)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError


class FusedMoE(MoELayer):
    """Router plus stacked float experts of one MoE MLP (module docstring).

    Args:
        num_experts: E; top_k: experts per token; hidden_size: H;
        intermediate_size: each expert's full (unsharded) intermediate size I;
        renormalize: divide the top-k weights by their sum (`select_experts`).
        tp: the TP group; with ``tp.expert_parallel`` it splits the experts, else their features.

    ``forward(h [T, H]) -> [T, H]``, ``h`` in the layer's dtype.

    Raises (from the constructor):
        ModelConfigMismatch: E (expert parallel) or I (otherwise) not divisible by the TP size.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ) -> None:
        super().__init__(num_experts, top_k, hidden_size, renormalize=renormalize, dtype=dtype)
        self.tp = tp
        self.kernels = kernels
        if tp.expert_parallel:
            self.num_local_experts = tp.shard(num_experts, "num_experts (expert parallel)")
            self.intermediate_local = intermediate_size
            self.first_expert = tp.rank * self.num_local_experts
        else:
            self.num_local_experts = num_experts
            self.intermediate_local = tp.shard(intermediate_size, "the experts' intermediate_size")
            self.first_expert = 0
        self.intermediate_size = intermediate_size
        e, i = self.num_local_experts, self.intermediate_local
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)

    def grouped_applies(self, h: torch.Tensor) -> bool:
        """Whether `experts_grouped` runs for ``h``: on CPU, with ``grouped_mm`` in this torch,
        rows of H and of I_local elements that are multiples of 16 bytes (its stride rule)."""
        size = h.dtype.itemsize
        return (
            GROUPED_MM
            and h.device.type == "cpu"
            and (self.w13.shape[2] * size) % 16 == 0
            and (self.intermediate_local * size) % 16 == 0
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.forward_local(h))

    def forward_local(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output (``[T, H]``, ``h.dtype``): what its experts, or its
        slice of every expert's features, contribute; the ranks' parts sum to the output."""
        weights, ids = self.route(h)
        if self.grouped_applies(h):
            return experts_grouped(h, self.w13, self.w2, weights, ids, self.first_expert, self.kernels)
        return experts_reference(h, self.w13, self.w2, weights, ids, self.first_expert)

    # ---- weights ---------------------------------------------------------------------------

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's full HF weight: ``part`` "gate" or "up" ``[I, H]``, "down" ``[H, I]``;
        kept when the expert is local, in this rank's slice of its features. An expert held by
        another rank (expert parallelism) is skipped."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside [0, {self.num_experts})")
        e = expert - self.first_expert
        if not 0 <= e < self.num_local_experts:
            return
        i = self.intermediate_local
        rank = 0 if self.tp.expert_parallel else self.tp.rank
        feats = slice(rank * i, (rank + 1) * i)
        if part == "down":
            _check_full(tensor, (self.w2.shape[1], self.intermediate_size), f"expert {expert} down")
            self.w2[e].copy_(tensor[:, feats])
        elif part in ("gate", "up"):
            _check_full(tensor, (self.intermediate_size, self.w13.shape[2]), f"expert {expert} {part}")
            self.w13[e, (0 if part == "gate" else i) : (i if part == "gate" else 2 * i)].copy_(tensor[feats])
        else:
            raise ValueError(f"unknown expert part {part!r}")


def _check(src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    _check_full(src, tuple(dst.shape), what)


def _check_full(src: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(src.shape) != shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match the model's {shape}")


def load_moe_tensor(moe: MoELayer, rest: str, tensor: torch.Tensor, parts: dict[str, str]) -> bool:
    """Load a checkpoint tensor of an MoE block by its name after the block's prefix: the router
    ``gate.weight`` or ``experts.{N}.{name}.weight`` with ``parts`` mapping each per-expert name
    to "gate", "up" or "down" (Mixtral: ``w1``/``w3``/``w2``; Qwen3-MoE: ``gate_proj``/...).
    False for any other name (the caller reports it)."""
    if rest == "gate.weight":
        moe.load_router(tensor)
        return True
    head, _, tail = rest.partition(".")
    idx, _, leaf = tail.partition(".")
    name, _, kind = leaf.partition(".")
    if head != "experts" or not idx.isdigit() or name not in parts or kind != "weight":
        return False
    moe.load_expert(int(idx), parts[name], tensor)
    return True


def expert_names(prefix: str, num_experts: int, parts: dict[str, str]) -> list[str]:
    """Every checkpoint name of an MoE block under ``prefix`` (router and each expert's parts)."""
    return [prefix + "gate.weight"] + [f"{prefix}experts.{e}.{p}.weight" for e in range(num_experts) for p in parts]
