"""`LoRAManager`: the runner's adapters: a host-memory cache of loaded adapters and the model's
adapter slots (vLLM's ``LRUCacheWorkerLoRAManager``).

* Host cache: up to ``lora.max_cpu_loras`` checked adapters (`LoRAAdapter`, float32 tensors),
  least recently used dropped first. An adapter a request needs and the cache lacks is read
  from its ``lora_path`` again.
* Slots: ``lora.max_loras`` of them on every linear that takes adapters (`LinearSlots`). Each
  step, every adapter the step's requests use gets a slot: the one it holds, else a free one,
  else the least recently used slot no request of this step needs. The scheduler never
  schedules more distinct adapters than slots (`pkgd.engine.scheduler`), so one always exists.
* The step's map: each token's slot (-1 for the base model), set on the shared `LoRAStep`
  before the forward; built with one ``repeat_interleave`` over the step's sequences.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from pkgd.config.sections import LoRAConfig
from pkgd.lora_request import LoRARequest
from pkgd.runner.lora.adapter import LinearShape, LoRAAdapter, LoRAAdapterError, load_adapter
from pkgd.runner.lora.layers import LinearSlots, LoRAStep

_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class LoRAManager:
    """Adapters of one model replica (one TP rank): see the module docstring.

    Args:
        model: a model of `pkgd.runner.models` (the Llama family's layer structure); its
            linears get `LinearSlots` and it gets ``lora_step`` (read by its CPU decode
            fast path, which steps aside while adapters are in use).
        config: the ``lora`` section. dtype: the slots' dtype (``lora_dtype`` resolved).
    """

    def __init__(self, model: Any, config: LoRAConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.step = LoRAStep()
        self.shapes: dict[tuple[int, str], LinearShape] = {}
        self.slots_of: dict[tuple[int, str], LinearSlots] = {}
        for i, layer in enumerate(model.layers):
            for group, name in _LINEARS:
                linear = getattr(getattr(layer, group, None), name, None)
                if linear is None:  # an MoE layer's MLP: experts take no adapters
                    continue
                self.shapes[(i, name)], linear.lora = self._attach(linear, dtype, device)
                self.slots_of[(i, name)] = linear.lora
        model.lora_step = self.step
        self.cache: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slot_ids: list[int | None] = [None] * self.max_loras  # slot -> adapter id
        self.slot_lru: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(self.max_loras)
        )

    def _attach(self, linear: Any, dtype: torch.dtype, device: torch.device) -> tuple[LinearShape, LinearSlots]:
        tp = getattr(linear, "tp", None)
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        if hasattr(linear, "shard_counts"):  # MergedColumnParallelLinear: each part's rows of this rank
            rows, start = [], 0
            for i, full in enumerate(linear.part_sizes):
                local = linear._rows(i, full)
                rows.append(slice(start + local.start, start + local.stop))
                start += full
            shape = LinearShape(linear.in_features, tuple(linear.part_sizes))
            in_slice, in_local = None, linear.in_features
        elif hasattr(linear, "in_local"):  # RowParallelLinear: this rank's input columns
            full_in = linear.in_local * size
            rows = [slice(0, linear.out_features)]
            shape = LinearShape(full_in, (linear.out_features,))
            in_slice, in_local = slice(rank * linear.in_local, (rank + 1) * linear.in_local), linear.in_local
        else:  # QuantizedLinear (TP size 1): its parts, unsharded
            sizes = list(linear.part_sizes)
            rows = [slice(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
            shape = LinearShape(linear.in_features, tuple(sizes))
            in_slice, in_local = None, linear.in_features
        slots = LinearSlots(
            self.step,
            num_slots=self.max_loras,
            max_rank=self.max_rank,
            in_features=in_local,
            part_rows=rows,
            in_slice=in_slice,
            dtype=dtype,
            device=device,
        )
        return shape, slots

    # ---- adapters ---------------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Load and check ``request``'s adapter into the host cache (a no-op when cached);
        raises `LoRAAdapterError` naming the problem, changing nothing."""
        cached = self.cache.get(request.lora_int_id)
        if cached is not None:
            self.cache.move_to_end(request.lora_int_id)
            return cached
        adapter = load_adapter(
            request.lora_path,
            request.lora_name,
            request.lora_int_id,
            shapes=self.shapes,
            max_rank=self.max_rank,
            row_layout=self.model._to_pair_layout,
        )
        while len(self.cache) >= self.max_cpu_loras:
            self.cache.popitem(last=False)
        self.cache[request.lora_int_id] = adapter
        return adapter

    def remove_adapter(self, int_id: int) -> bool:
        """Forget adapter ``int_id`` (cache and slot); whether it was known."""
        found = self.cache.pop(int_id, None) is not None
        for slot, held in enumerate(self.slot_ids):
            if held == int_id:
                self.slot_ids[slot] = None
                found = True
        return found

    def list_adapters(self) -> list[int]:
        return list(self.cache)

    # ---- one step ---------------------------------------------------------------------------

    def prepare_step(self, requests: list[LoRARequest | None], query_lens: list[int], device: torch.device) -> None:
        """Give every adapter of this step a slot and set the token map (module docstring).

        ``requests[i]``: request i's adapter (None = base); ``query_lens[i]``: its tokens this
        step (all of them: a speculating request's 1 + k count as one request).

        Raises:
            LoRAAdapterError: more distinct adapters than slots (the scheduler's bound broken),
                or an adapter that no longer loads from its path.
        """
        wanted: dict[int, LoRARequest] = {r.lora_int_id: r for r in requests if r is not None}
        if not wanted:
            self.step.token_slots, self.step.active = None, []
            return
        if len(wanted) > self.max_loras:
            raise LoRAAdapterError(f"{len(wanted)} adapters in one step, more than lora.max_loras {self.max_loras}")
        slot_of = {aid: s for s, aid in enumerate(self.slot_ids) if aid in wanted}
        for aid, req in wanted.items():
            if aid not in slot_of:
                slot_of[aid] = self._load_slot(req, busy=set(slot_of.values()))
        for s in sorted(slot_of.values()):
            self.slot_lru.move_to_end(s)
        per_seq = torch.tensor([-1 if r is None else slot_of[r.lora_int_id] for r in requests], dtype=torch.int64)
        slots = per_seq.repeat_interleave(torch.tensor(query_lens, dtype=torch.int64))
        self.step.token_slots = slots.to(device)
        self.step.active = sorted(set(slot_of.values()))

    def _load_slot(self, req: LoRARequest, busy: set[int]) -> int:
        free = [s for s, aid in enumerate(self.slot_ids) if aid is None and s not in busy]
        slot = free[0] if free else next(s for s in self.slot_lru if s not in busy)
        adapter = self.add_adapter(req)
        for key, slots in self.slots_of.items():
            slots.set_slot(slot, adapter.deltas.get(key))
        self.slot_ids[slot] = req.lora_int_id
        return slot

    def clear_step(self) -> None:
        self.step.token_slots, self.step.active = None, []
