"""Adapter slots on the model's linears, and the step's token-to-slot map they read.

Each linear that takes adapters (a fused Q/K/V or gate/up column-parallel linear, an o/down
row-parallel one, or their GGUF `QuantizedLinear` forms) gets a `LinearSlots`: stacked
``a [max_loras, R, in_local]`` and ``b [max_loras, out_local, R]`` buffers, ``R`` = the
linear's parts x ``max_lora_rank``. Sharded as the base layer is (vLLM's layout): a
column-parallel linear keeps each part's rows of ``b`` for this rank and all of ``a``; a
row-parallel one keeps this rank's input columns of ``a`` and all of ``b``, and its update is
added before the all-reduce (``B (sum_ranks A_r x_r)`` = the sum of the ranks' updates).

The layer's forward calls `LinearSlots.apply(x, y)`, which adds the update of every token
whose request runs with an adapter (`pkgd_kernels.add_lora`) and returns ``y`` untouched when
no token of the step does. The runner sets the shared `LoRAStep` before each forward.
"""

from __future__ import annotations

import dataclasses

import torch

import pkgd_kernels as pk
from pkgd.runner.lora.adapter import LinearDelta


@dataclasses.dataclass
class LoRAStep:
    """One step's map, shared by every `LinearSlots` of a model: ``token_slots`` int64
    ``[T]`` on the model's device (-1 = base model), ``active`` the slots in use, ascending
    (empty: no token uses an adapter)."""

    token_slots: torch.Tensor | None = None
    active: list[int] = dataclasses.field(default_factory=list)

    @property
    def any_active(self) -> bool:
        return bool(self.active)


class LinearSlots:
    """The adapter slots of one linear (module docstring).

    Args:
        step: the model's shared `LoRAStep`.
        num_slots: ``lora.max_loras``. max_rank: ``lora.max_lora_rank``.
        in_features: the linear's local input size; part_rows: per part, the full output
            rows and this rank's slice of them (column-parallel), or one part whose slice is
            all of it (row-parallel).
        in_slice: this rank's input columns (row-parallel), None = all.
    """

    def __init__(
        self,
        step: LoRAStep,
        *,
        num_slots: int,
        max_rank: int,
        in_features: int,
        part_rows: list[slice],
        in_slice: slice | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.step = step
        self.part_rows = part_rows
        self.in_slice = in_slice
        self.rank = len(part_rows) * max_rank
        out_local = sum(s.stop - s.start for s in part_rows)
        self.a = torch.zeros(num_slots, self.rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_local, self.rank, dtype=dtype, device=device)
        # B again as [slots, R, out] on CPU: the CPU form's expand reads the slots in use as one
        # [n*R, out] matrix (`pkgd_kernels.add_lora_cpu`); the Triton kernel reads ``b``.
        self.b_t = torch.zeros(num_slots, self.rank, out_local, dtype=dtype) if device.type == "cpu" else None

    def set_slot(self, slot: int, delta: LinearDelta | None) -> None:
        """Write one adapter's update of this linear into ``slot`` (None: it has none here:
        zeros, so the slot adds nothing for this linear)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.b_t is not None:
            self.b_t[slot].zero_()
        if delta is None:
            return
        r = delta.a.shape[0]
        a = delta.a if self.in_slice is None else delta.a[:, self.in_slice]
        b = torch.cat([delta.b[rows] for rows in self.part_rows])
        self.a[slot, :r].copy_(a)
        self.b[slot, :, :r].copy_(b)
        if self.b_t is not None:
            self.b_t[slot].copy_(self.b[slot].t())

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y [T, out_local] += B[slot_t] A[slot_t] x[t]`` for every token with an adapter."""
        step = self.step
        if not step.active or step.token_slots is None:
            return y
        if x.dtype == self.a.dtype:
            return pk.add_lora(y, x, self.a, self.b, step.token_slots, active=step.active, lora_b_t=self.b_t)
        # lora.lora_dtype other than the activations': the update in the adapters' dtype
        delta = torch.zeros(y.shape, dtype=self.a.dtype, device=y.device)
        pk.add_lora(delta, x.to(self.a.dtype), self.a, self.b, step.token_slots, active=step.active, lora_b_t=self.b_t)
        return y.add_(delta.to(y.dtype))
