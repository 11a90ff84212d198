"""Attention with the KV cache in host memory, as the decoder's `attend` argument.

Per layer: hand the new KV to the OffloadEngine (staging or device tails, and on its way
to the host), show the policy the new keys, attend over what is on the device (the new
chunk itself, the tails), then over each ring slot of host KV as it lands, merging by
LSE. Loads run ahead of compute, across layer boundaries (kvcache.offload_engine.RingLoads).

On a layer where the step's plan selects decode pages (`PolicyRuntime.plan_step`), the
decode rows' host KV does not go through the ring: the chosen pages are read in place
from the host pool by a device kernel (OffloadEngine.gather_pages, or the policy's own
`load_pages`, which may keep pages on the device), so only they cross PCIe. On the
layers whose prefill attention the policy replaces (`PolicyTraits.prefill_layers`: a
sparse prefill method, whose estimate needs every key of the prefix), prefill rows do
not use the ring either: each chunk's prefix comes to the device
whole, a layer ahead of compute (OffloadEngine.context_loads), and the policy attends over
prefix and chunk at once, exactly as on the resident path. The layers the policy never
makes sparse (the engine's `device_layers`) keep their whole cache on the device and
attend there as on the resident path (PagedAttention over `on_device`).

A policy that prefetches (`PolicyTraits.prefetches`) gets, at the start of each layer l
(`lookahead`, called by the decoder), layer l+1's query predicted from the residual stream
entering layer l (`predict`, Decoder.early_query), on the engine's prefetch stream: what
it loads there overlaps layer l's compute, and layer l+1 waits for it before its own
selection. Where the prefetch returns its selection (Quest's `late_fetch=False`), layer l+1
reads those pages and selects nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from astream.executor.offload_plan import JobTemplate, OffloadStepPlan
from astream.executor.paged_attention import PagedAttention, prefill_attention
from astream.kvcache.context_loads import ContextLoads
from astream.kvcache.offload_engine import OffloadEngine, RingLoads, RingSlot
from astream.ops.backends import AttentionBackends
from astream.policies import DecodeQuery, PolicyRuntime, PrefetchedPages, StepPlan, StepShape
from astream.runtime.events import Event

# predict(layer, residual [T, hidden], positions [T]) -> that layer's query [T, H, D]
PredictFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def plan_offloaded_step(plan: OffloadStepPlan, policy: PolicyRuntime) -> StepPlan:
    """The policy's plan of an offloaded step: its decode rows select among their host blocks."""
    context = plan.decode_context
    if context is None:
        return policy.plan_step(StepShape(0, 0))
    return policy.plan_step(StepShape(context.rows.shape[0], context.max_context))


@dataclass(slots=True)
class OffloadAttention:
    engine: OffloadEngine
    plan: OffloadStepPlan
    loads: RingLoads
    step: StepPlan                       # the policy's plan of this step
    slots: torch.Tensor                  # [T] host-pool slot of each new token
    backends: AttentionBackends
    policy: PolicyRuntime
    scale: float
    on_device: PagedAttention | None = None        # the engine's device layers, read in place
    contexts: ContextLoads | None = None           # whole prefixes of whole-prefill layers
    gathered_views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    predict: PredictFn | None = None               # the early query, where the policy prefetches
    # layer -> its prefetch's events (selection, load), and the pages it chose where the
    # layer is to read them
    prefetched: dict[int, tuple[tuple[Event | None, ...], PrefetchedPages | None]] = field(
        default_factory=dict)

    @property
    def lookahead(self) -> Callable[[int, torch.Tensor, torch.Tensor], None] | None:
        """The decoder's hook at each layer's start, where this step prefetches."""
        prefetches = (self.predict is not None and self.policy.traits.prefetches
                      and self.step.load_pages and self.plan.decode_context is not None
                      and self.plan.decode_context.owners is not None)
        return self._prefetch_next if prefetches else None

    def _prefetch_next(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Layer `layer` starts: the policy prefetches for the next layer, on the engine's
        prefetch stream, after what compute has queued so far (hidden is written by then)."""
        target = layer + 1
        if target not in self.step.select_layers or target in self.engine.device_layers:
            return
        context, rt, stream = self.plan.decode_context, self.engine.runtime, self.engine.prefetch
        rt.wait(rt.record_event(), stream)
        if stream is not None:
            # Compute frees `hidden` a layer on, while this stream may still read it.
            hidden.record_stream(stream)
            positions.record_stream(stream)
        self.engine.prefetch_loaded = None      # set by a load the prefetch queues
        with rt.on(stream):
            if not context.every_row:
                hidden, positions = hidden.index_select(0, context.rows), positions.index_select(0, context.rows)
            q = self.predict(target, hidden, positions)
            predicted = self.policy.prefetch_pages(target, DecodeQuery(
                q, context.block_tables, context.context_lens, context.max_context, physical=True),
                self.engine, context.owners)
            events = (rt.record_event(stream),)
        if self.engine.prefetch_loaded is not None:     # its load ran on the engine's load stream
            events += (self.engine.prefetch_loaded,)
            self.engine.prefetch_loaded = None
        self.prefetched[target] = events, predicted

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.engine.device_layers:
            return self.on_device(layer, q, k, v)
        stored = self.engine.write_layer(layer, k, v, self.plan.new_kv)
        if self.policy.traits.watches_keys:
            self.policy.on_kv_written(layer, stored, self.slots)
        out, lse = self._on_device(layer, q, k, v)
        sparse = layer in self.step.select_layers
        if sparse:
            out, lse = self._selected_pages(layer, q, out, lse)
        jobs = self.plan.layer_jobs(layer, sparse)
        for job, slot in self.loads.layer(layer):
            out, lse = self._over_slot(layer, slot, jobs[job], q, out, lse)
        return out

    def _on_device(self, layer: int, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The new chunks attend causally to themselves; single tokens to their tail block."""
        plan, split = self.plan, self.plan.num_prefill_tokens
        parts = []
        if split and plan.reads_whole_prefill(layer):
            parts.append(self._whole_prefill(layer, q[:split], k[:split], v[:split]))
        elif split:
            parts.append(prefill_attention(self.policy, self.backends, layer, q[:split], k[:split],
                                           v[:split], plan.chunk_meta, causal=True, scale=self.scale))
        if split < q.shape[0]:
            tail_k, tail_v = self.engine.tails(layer)
            parts.append(self.backends.paged_decode(
                q[split:], tail_k, tail_v, plan.decode_tail_tables, plan.decode_tail_lens,
                scale=self.scale, max_context_len=tail_k.shape[1],
                kv_scales=self.engine.scales(layer)))
        if len(parts) == 1:
            return parts[0][0], parts[0][1].contiguous()
        return torch.cat((parts[0][0], parts[1][0])), torch.cat((parts[0][1], parts[1][1]))

    def _whole_prefill(self, layer: int, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill chunks over their whole context (prefix from the host pool, then
        themselves), packed as the resident path packs it, for the policy to replace."""
        context = self.plan.prefill_context
        packed = self.contexts.keys(layer)
        packed.k.index_copy_(0, context.chunk_rows, k)
        packed.v.index_copy_(0, context.chunk_rows, v)
        out = prefill_attention(self.policy, self.backends, layer, q, packed.k, packed.v,
                                context.meta, causal=True, scale=self.scale)
        self.contexts.release()
        return out

    def _selected_pages(self, layer: int, q, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows over the host pages the policy chooses, gathered straight from the pool."""
        context = self.plan.decode_context
        # Its prefetch updates the page buffers this layer's load_pages reads and plans on, or
        # holds the pages it reads instead of its own selection.
        prefetch, predicted = self.prefetched.pop(layer, ((), None))
        for event in prefetch:
            self.engine.runtime.wait(event)
        q_dec = q if context.every_row else q.index_select(0, context.rows)
        pages, slot_list = None, None           # (k, v) on the device; the slot of each page
        if predicted is not None:               # chosen and loaded a layer ahead
            chosen = predicted.chosen
            if predicted.k is not None:
                pages, slot_list = (predicted.k, predicted.v), predicted.slots
        else:
            chosen = self.policy.select_decode(layer, DecodeQuery(
                q_dec, context.block_tables, context.context_lens, context.max_context, physical=True))
            if self.step.load_pages and context.owners is not None:
                reused = self.policy.load_pages(layer, chosen, self.engine, context.owners)
                if reused is not None:          # the pages sit in the rows' slots, in any order
                    pages, slot_list = reused[:2], reused[2]
        if pages is None:
            pages = self.engine.gather_pages(layer, chosen.physical, chosen.counts, chosen.page_size)
        dk, dv = pages
        rows, heads, picked = chosen.indices.shape
        tokens = dk.shape[2]                    # a buffer may hold more slots than pages picked
        if tokens not in self.gathered_views:   # the same shapes on the sparse layers of a step
            self.gathered_views[tokens] = gathered_view(rows, heads, picked, tokens, q.device)
        own_block, in_order, every_token = self.gathered_views[tokens]
        page_list = in_order if slot_list is None else slot_list
        part = self.backends.paged_decode_selected(
            q_dec, dk.transpose(1, 2), dv.transpose(1, 2), own_block, page_list, chosen.counts,
            every_token, page_size=chosen.page_size, scale=self.scale,
            kv_scales=self.engine.scales(layer))
        return self.backends.merge_into_rows(out, lse, context.rows, *part)

    def _over_slot(self, layer: int, slot: RingSlot, job: JobTemplate, q, out,
                   lse) -> tuple[torch.Tensor, torch.Tensor]:
        if job.prefill_index is not None:
            keys = job.prefill_blocks
            # Dequantized straight from the head-major slot (no token-major fp8 copy first).
            k, v = self.engine.format.dequantize(layer, slot.k_tokens[:keys], slot.v_tokens[:keys])
            k, v = k.flatten(0, 1), v.flatten(0, 1)
            part = prefill_attention(
                self.policy, self.backends, layer, q.index_select(0, job.prefill_index), k, v,
                job.prefill_meta, causal=False, scale=self.scale)
            out, lse = self.backends.merge_into_rows(out, lse, job.prefill_index, *part)
        if job.decode_index is not None:
            part = self.backends.paged_decode(
                q.index_select(0, job.decode_index), slot.k_tokens, slot.v_tokens,
                job.decode_table_tensor, job.decode_lens, scale=self.scale,
                max_context_len=job.decode_max, kv_scales=self.engine.scales(layer))
            out, lse = self.backends.merge_into_rows(out, lse, job.decode_index, *part)
        return out, lse


def whole_prefill_loads(engine: OffloadEngine, plan: OffloadStepPlan,
                        num_layers: int) -> ContextLoads | None:
    """The step's prefix loads for the offloaded layers whose prefill the policy replaces."""
    context = plan.prefill_context
    if context is None:
        return None
    layers = [layer for layer in range(num_layers)
              if plan.reads_whole_prefill(layer) and layer not in engine.device_layers]
    return engine.context_loads(context.prefix_runs, layers, context.num_keys) if layers else None


def gathered_view(rows: int, heads: int, picked: int, tokens: int,
                   device: torch.device) -> tuple[torch.Tensor, ...]:
    """Gathered pages as a cache of one "block" of `tokens` per row, read through its own
    page list: (block table, page lists, context lengths)."""
    own_block = torch.arange(rows, dtype=torch.int32, device=device).view(rows, 1)
    page_list = torch.arange(picked, dtype=torch.int32, device=device).expand(rows, heads, picked)
    every_token = torch.full((rows,), tokens, dtype=torch.int32, device=device)
    return own_block, page_list, every_token
