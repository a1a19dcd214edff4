"""The Llama-family decoder (Llama, Qwen2, SmolLM2) over a flattened ragged batch.

One call processes N new tokens belonging to several sequences. Everything that is per-token (embedding,
projections, MLP) runs once over all N rows, so cost follows N with no padding; attention runs per
sequence against that sequence's own KV cache; the final norm and the (large) LM head run only on the
rows whose logits were asked for. Conventions follow Hugging Face: rotate-half RoPE, RMSNorm computed in
float32, q/k/v bias on Qwen2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import ChunkAttention
from .ggml import Q6KBlocks, Q6KWeight, q6k_kernels, q6k_row_limit
from .model_config import ModelConfig
from .norm import rms_norm
from .q4k import Q4K_ROWS, Q4KBlocks, Q4KWeight, q4k_kernels
from .quant import Int4Groups, QuantizedWeight, quantizable


class SplitWeight:
    """A fused weight whose parts are stored in different formats (a Q4_K_M file's Q4_K q and k beside
    a Q6_K v): each run of parts through its own kernel, the outputs side by side, at up to the parts'
    least row limit; the fused `dense` weight above it."""

    def __init__(self, parts: list[Q4KWeight | Q6KWeight], dense: torch.Tensor) -> None:
        self.parts, self.dense, self.shape = parts, dense, dense.shape
        self.max_rows = min(p.max_rows for p in parts)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p.matmul(x) for p in self.parts], dim=-1)
        return out if bias is None else out + bias


# Weights with a quantized copy for forwards over at most `max_rows` rows, beside their dense path.
ROW_LIMITED = (QuantizedWeight, Q6KWeight, Q4KWeight, SplitWeight)

# KV caches grow in blocks of this many positions (copying the cache each time: one copy per 256 decoded
# tokens costs well under 1 % of decoding; doubling would leave up to half of a cache unused and uncounted).
KV_BLOCK_TOKENS = 256


class KVCache:
    """Keys and values of one sequence, all layers: `k[layer]` is `[kv_heads, capacity, head_dim]`.

    Capacity grows geometrically so appending one token at a time does not reallocate every step;
    `length` is the number of valid positions (rolling back is just lowering it)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self._shape = (config.num_layers, config.num_kv_heads, 0, config.head_dim)
        self.k = torch.empty(self._shape, dtype=dtype, device=device)
        self.v = torch.empty(self._shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, needed: int, limit: int) -> None:
        """Make room for `needed` positions: capacity grows in blocks of KV_BLOCK_TOKENS (at most `limit`
        unless more is needed), so it never exceeds what the engine's KV budget counts for the sequence."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, min(limit, -(-needed // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS))
        layers, heads, _, head_dim = self._shape
        shape = (layers, heads, new_cap, head_dim)
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.empty(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def copy(self, length: int, limit: int) -> KVCache:
        """A new cache holding this one's first `length` positions."""
        out = KVCache.__new__(KVCache)
        out._shape, out.length = self._shape, 0
        out.k, out.v = self.k[:, :, :0], self.v[:, :, :0]
        out.reserve(length, limit)
        out.k[:, :, :length] = self.k[:, :, :length]
        out.v[:, :, :length] = self.v[:, :, :length]
        out.length = length
        return out


@dataclass
class SeqChunk:
    """One sequence's share of a ragged batch: rows `start:end` of the flattened tokens, appended to
    `cache` at positions `cache.length ..`. The caller bumps `cache.length` after the forward."""

    start: int
    end: int
    cache: KVCache


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with HF's linear / llama3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band in between interpolated.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq  # "default"


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x [N, heads, d]: x cos + rotate_half(x) sin, with rotate_half's negation folded
    into `signed_sin` (-sin on the first half), so the halves swap with one flip (the same values)."""
    n, heads, d = x.shape
    swapped = x.view(n, heads, 2, d // 2).flip(2).view(n, heads, d)
    return x * cos + swapped * signed_sin


class PackedWeight:
    """A bf16 or float32 weight reordered once into oneDNN's blocked layout (CPU only). Its matmuls run
    1.2-2x faster than `F.linear` on the plain layout at the small row counts of decoding and
    verification in bf16 on an AVX512-BF16 CPU, and 2-5x faster in float32 from 2 to 32 rows on an
    AVX2 one (where MKL's float32 GEMM is at its worst at a few rows)."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = 64) -> None:
        self.shape = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight | QuantizedWeight | Q6KWeight | Q4KWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if isinstance(weight, ROW_LIMITED):
        if x.shape[0] <= weight.max_rows:
            return weight.matmul(x, bias)
        weight = weight.dense  # more rows: the bf16 GEMM is faster
    if isinstance(weight, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_pack_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN weight packing applies here: CPU, bf16 or float32, and a self-check that it agrees
    with `F.linear` (the ops are PyTorch internals, and bf16 packing needs AVX512 or AVX-NE-CONVERT:
    where they fail, the plain path stays)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=g).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        return torch.allclose(
            linear(x, PackedWeight(w), b).float(), F.linear(x, w, b).float(), atol=0.05, rtol=0.02
        )
    except (AttributeError, RuntimeError):
        return False


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_norm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        # q, k and v share one matmul (one pass over the activations, one bigger GEMM).
        self.wqkv = nn.Parameter(torch.empty(q_size + 2 * kv_size, c.hidden_size), requires_grad=False)
        self.bqkv = (
            nn.Parameter(torch.empty(q_size + 2 * kv_size), requires_grad=False) if c.attention_bias else None
        )
        self.wo = nn.Parameter(torch.empty(c.hidden_size, q_size), requires_grad=False)
        self.bo = (
            nn.Parameter(torch.empty(c.hidden_size), requires_grad=False) if c.attention_out_bias else None
        )
        self.mlp_norm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.w_gate_up = nn.Parameter(
            torch.empty(2 * c.intermediate_size, c.hidden_size), requires_grad=False
        )
        self.w_down = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size), requires_grad=False)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size), requires_grad=False)
        )
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        consume: bool = False,
    ) -> LlamaModel:
        """Build from unfused weights named `embed`, `norm`, `lm_head`, `layers.{i}.{attn_norm, q, k, v,
        q_bias, k_bias, v_bias, o, o_bias, mlp_norm, gate, up, down}` (shapes as in HF: [out, in]).
        Missing names raise KeyError (`missing_weights` tells beforehand), wrong shapes ValueError.
        `consume=True` pops entries from `weights` (a dict) as they are fused, so the unfused copies are
        freed layer by layer instead of doubling peak memory."""
        missing = missing_weights(config, weights)
        if missing:
            raise KeyError(f"missing weights: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        for name, shape in weight_shapes(config).items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")
        with torch.device("meta"):
            model = cls(config)
        device = torch.device(device)

        def take(*names: str) -> nn.Parameter:
            parts = [
                (weights.pop(n) if consume else weights[n]).to(device=device, dtype=dtype) for n in names
            ]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            return nn.Parameter(t.contiguous(), requires_grad=False)

        model.embed = take("embed")
        model.norm = take("norm")
        if config.tie_word_embeddings:
            model.lm_head = None
        else:
            model.lm_head = take("lm_head")
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            layer.attn_norm = take(p + "attn_norm")
            layer.wqkv = take(p + "q", p + "k", p + "v")
            layer.bqkv = take(p + "q_bias", p + "k_bias", p + "v_bias") if config.attention_bias else None
            layer.wo = take(p + "o")
            layer.bo = take(p + "o_bias") if config.attention_out_bias else None
            layer.mlp_norm = take(p + "mlp_norm")
            layer.w_gate_up = take(p + "gate", p + "up")
            layer.w_down = take(p + "down")
        freqs = rope_inv_freq(config)
        if weights.get("rope_freqs") is not None:  # llama3-style GGUFs: per-frequency divisors
            freqs = freqs / weights["rope_freqs"].float().cpu()
        model.inv_freq = freqs.to(device)
        return model

    @property
    def is_packed(self) -> bool:
        weight = self.layers[0].wqkv if len(self.layers) > 0 else None
        if isinstance(weight, ROW_LIMITED):
            weight = weight.dense
        return isinstance(weight, PackedWeight)

    def pack_weights(self, batch_hint: int = 64) -> None:
        """Replace the matmul weights by oneDNN-packed copies (see `PackedWeight`; check
        `can_pack_weights` first). Irreversible; the plain copies are freed. A tied LM head stays plain:
        the embedding lookup needs the plain table."""
        if self.is_packed:  # several runners may share one model (e.g. target and draft in tests)
            return
        for layer in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                weight = getattr(layer, name)
                if isinstance(weight, ROW_LIMITED):  # quantized first: pack its bf16 path
                    weight.dense = PackedWeight(weight.dense, batch_hint)
                    continue
                delattr(layer, name)  # unregister the Parameter so a plain attribute can take its place
                setattr(layer, name, PackedWeight(weight, batch_hint))
        if isinstance(self.lm_head, ROW_LIMITED):
            if self.lm_head.dense is not self.embed:  # a tied head's dense path is the lookup table
                self.lm_head.dense = PackedWeight(self.lm_head.dense, batch_hint)
        elif self.lm_head is not None:
            weight = self.lm_head
            del self.lm_head
            self.lm_head = PackedWeight(weight, batch_hint)

    def quantize_weights(self, bits: int = 4, max_rows: int = 4, group_size: int = 32) -> None:
        """Give every layer matmul weight and the LM head a quantized copy (see `QuantizedWeight`), used by
        forwards over at most `max_rows` rows; more rows keep the bf16 path (packed or plain). A tied head
        becomes `lm_head` with the embedding table as its bf16 path (lookups still use `embed`). Weights
        whose shape the kernel cannot take stay as they are; calling again re-quantizes from the bf16
        copies. Check `quant.can_quantize_weights` first. Extra memory: the quantized copies, 0.31x the
        bf16 weights' bytes at int4 group 32 (294 MiB on the 0.5B draft), 0.27x at group 128, 0.5x at int8."""

        def wrap(
            weight: torch.Tensor | PackedWeight | QuantizedWeight,
        ) -> torch.Tensor | PackedWeight | QuantizedWeight:
            if isinstance(weight, ROW_LIMITED):
                weight = weight.dense
            if not quantizable(weight.shape, bits, group_size):
                return weight
            plain = weight.packed.to_dense() if isinstance(weight, PackedWeight) else weight.detach()
            return QuantizedWeight(plain, weight, bits, group_size, max_rows)

        for layer in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                weight = getattr(layer, name)
                if isinstance(weight, nn.Parameter):
                    delattr(layer, name)  # unregister the Parameter so a plain attribute can take its place
                setattr(layer, name, wrap(weight))
        head = wrap(self.embed if self.lm_head is None else self.lm_head)
        if head is not self.embed:  # else tied and not quantizable: stays tied
            if isinstance(self.lm_head, nn.Parameter):
                del self.lm_head
            self.lm_head = head

    def int4_weights(self) -> int:
        """How many layer matmul weights have an int4 copy."""
        attrs = ("wqkv", "wo", "w_gate_up", "w_down")
        return sum(isinstance(getattr(layer, a), QuantizedWeight) for layer in self.layers for a in attrs)

    def q6k_weights(self) -> int:
        """How many matmul weights (LM head included) run their Q6_K blocks at small row counts."""
        return self._count(Q6KWeight)

    def q4k_weights(self) -> int:
        """How many matmul weights (LM head included) run their Q4_K blocks through `q4k.py`'s kernel."""
        return self._count(Q4KWeight)

    def _count(self, kind: type) -> int:
        attrs = ("wqkv", "wo", "w_gate_up", "w_down")
        layers = sum(isinstance(getattr(layer, a), kind) for layer in self.layers for a in attrs)
        return layers + isinstance(self.lm_head, kind)

    def use_checkpoint_codes(
        self, codes: dict[str, Int4Groups | Q6KBlocks | Q4KBlocks], max_rows: int
    ) -> int:
        """Give each matmul weight whose every part (`layers.{i}.q`, ... as `from_weights` names them) has
        its checkpoint's own quantized codes in `codes` a copy built from those codes, used by forwards
        over at most `max_rows` rows (Q6_K blocks: `q6k_row_limit()`; Q4_K blocks: `Q4K_ROWS`: the
        kernels' own measured limits). Q4_K blocks (`Q4KBlocks`, where `q4k.py`'s kernel runs) go to that
        kernel as stored; Q4_K codes (`Int4Groups`, 32-value groups) become an int4 copy
        (`QuantizedWeight`), not a re-quantization: only each group's scale and offset are rounded, to
        bf16, where a bf16 dense path rounds each weight to bf16 (a float32 model also hands the kernel
        bf16 copies of its activations). A single Q6_K part keeps its blocks for `ggml.py`'s kernel,
        exactly as stored. Call before packing. Returns how many weights took a copy."""
        fused = {"wqkv": ("q", "k", "v"), "wo": ("o",), "w_gate_up": ("gate", "up"), "w_down": ("down",)}
        kernels = q6k_kernels()
        done = 0

        def replace(
            weight: torch.Tensor, parts: list[Int4Groups | Q6KBlocks | Q4KBlocks]
        ) -> QuantizedWeight | Q6KWeight | Q4KWeight | SplitWeight | None:
            if len(parts) == 1 and isinstance(parts[0], Q6KBlocks):
                usable = kernels is not None and tuple(parts[0].shape) == tuple(weight.shape)
                return Q6KWeight(parts[0], weight.detach(), q6k_row_limit(), kernels) if usable else None
            if all(isinstance(p, Q4KBlocks) for p in parts):
                module = q4k_kernels()
                cat = Q4KBlocks.cat(parts)  # type: ignore[arg-type]
                if module is None or tuple(cat.shape) != tuple(weight.shape):
                    return None
                return Q4KWeight(cat, weight.detach(), Q4K_ROWS, module)
            if all(isinstance(p, (Q4KBlocks, Q6KBlocks)) for p in parts):
                return split(weight, parts)  # type: ignore[arg-type]
            if not all(isinstance(p, Int4Groups) for p in parts):
                return None  # Q4_K codes for the int4 path next to Q6_K blocks: the dense path
            cat = Int4Groups.cat(parts)
            if not quantizable(weight.shape, 4, 32) or tuple(cat.codes.shape) != tuple(weight.shape):
                return None
            return QuantizedWeight(weight, weight.detach(), 4, 32, max_rows, groups=cat)

        def split(weight: torch.Tensor, parts: list[Q4KBlocks | Q6KBlocks]) -> SplitWeight | None:
            q4k_module = q4k_kernels()
            if kernels is None or q4k_module is None or sum(p.shape[0] for p in parts) != weight.shape[0]:
                return None
            # The parts run only at their row counts (the fused dense path serves above): no dense copies.
            none = weight.new_empty(0)
            groups: list[list[Q4KBlocks | Q6KBlocks]] = []
            for p in parts:  # consecutive Q4_K parts share one matmul
                if groups and isinstance(p, Q4KBlocks) and isinstance(groups[-1][0], Q4KBlocks):
                    groups[-1].append(p)
                else:
                    groups.append([p])
            runs: list[Q4KWeight | Q6KWeight] = [
                Q6KWeight(g[0], none, q6k_row_limit(), kernels)
                if isinstance(g[0], Q6KBlocks)
                else Q4KWeight(Q4KBlocks.cat(g), none, Q4K_ROWS, q4k_module)  # type: ignore[arg-type]
                for g in groups
            ]
            return SplitWeight(runs, weight.detach())

        for i, layer in enumerate(self.layers):
            for attr, parts in fused.items():
                names = [f"layers.{i}.{p}" for p in parts]
                weight = getattr(layer, attr)
                if not all(n in codes for n in names) or not isinstance(weight, torch.Tensor):
                    continue
                new = replace(weight, [codes[n] for n in names])
                if new is not None:
                    delattr(layer, attr)  # unregister the Parameter so a plain attribute can take its place
                    setattr(layer, attr, new)
                    done += 1
        if self.lm_head is not None and "lm_head" in codes and isinstance(self.lm_head, torch.Tensor):
            new = replace(self.lm_head, [codes["lm_head"]])
            if new is not None:
                del self.lm_head
                self.lm_head = new
                done += 1
        return done

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        chunks: Sequence[SeqChunk],
        logit_rows: torch.Tensor | None = None,
        head: torch.Tensor | PackedWeight | QuantizedWeight | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [N]; chunks: each sequence's rows and cache (writes keys/values at
        `cache.length ..` but does not bump `length`); logit_rows: indices into N (None: all rows);
        head: an LM head to use instead of the model's (e.g. its rows for a token subset).
        Returns logits [len(logit_rows), head rows] in the model dtype."""
        c = self.config
        n_tokens = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = F.embedding(input_ids, self.embed)

        # cos/sin once per call, shared by all layers: [N, 1, head_dim] to broadcast over heads.
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype)[:, None, :]
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(h.dtype)[:, None, :]
        kernel, sdpa_chunks = ChunkAttention.split(chunks, h.dtype, h.device)
        masks = _chunk_masks(sdpa_chunks, c.num_kv_groups, h.dtype, h.device)

        mlp_out = None  # the previous layer's last output, added to the residual stream by the next norm
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps, add=mlp_out)
            qkv = linear(x, layer.wqkv, layer.bqkv)
            # q and k are side by side in qkv: one rotation for both.
            qk = qkv[:, : q_size + kv_size].view(n_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = rotate(qk, cos, signed_sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_size + kv_size :].view(n_tokens, c.num_kv_heads, c.head_dim)
            attn = self._attention(index, q, k, v, kernel, sdpa_chunks, masks)
            x = rms_norm(h, layer.mlp_norm, c.rms_norm_eps, add=linear(attn, layer.wo, layer.bo))
            gate, up = linear(x, layer.w_gate_up).chunk(2, dim=-1)
            mlp_out = linear(F.silu(gate) * up, layer.w_down)
        if mlp_out is not None:
            h = h + mlp_out

        if logit_rows is not None:
            if logit_rows.numel() == 0:  # prefill-only call: skip the LM head entirely
                return h.new_empty(0, c.vocab_size if head is None else head.shape[0])
            h = h.index_select(0, logit_rows)
        h = rms_norm(h, self.norm, c.rms_norm_eps)
        if head is None:
            head = self.embed if self.lm_head is None else self.lm_head
        return linear(h, head)

    def _attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernel: ChunkAttention | None,
        chunks: Sequence[SeqChunk],
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """q [N, heads, d], k/v [N, kv_heads, d] -> [N, heads * d]. Per sequence: write the new keys and
        values into its cache, then attend over the cache (causal within the new chunk): `kernel`'s
        chunks in one call, the others (`chunks`, with their `masks`) through SDPA one by one."""
        c = self.config
        groups, kv_heads, head_dim = c.num_kv_groups, c.num_kv_heads, c.head_dim
        out = torch.empty(q.shape[0], c.num_heads * head_dim, dtype=q.dtype, device=q.device)
        if kernel is not None:
            kernel(layer, q, k, v, out)
        for chunk, mask in zip(chunks, masks, strict=True):
            s, e, cache = chunk.start, chunk.end, chunk.cache
            n, total = e - s, cache.length + e - s
            cache.k[layer, :, cache.length : total] = k[s:e].transpose(0, 1)
            cache.v[layer, :, cache.length : total] = v[s:e].transpose(0, 1)
            # 4-D inputs: SDPA's fused CPU kernel only takes those (3-D falls back to the slow math path).
            keys, values = cache.k[layer, None, :, :total], cache.v[layer, None, :, :total]
            # GQA without copying K/V: fold each kv head's query group into the query-length axis,
            # [n, kv, g, d] -> [kv, g * n, d]; the causal mask is repeated per group to match.
            if n == 1:  # decode: the fold is a free view
                qg = q[s].view(1, kv_heads, groups, head_dim)  # reshape below: CUDA's output is strided
                out[s] = F.scaled_dot_product_attention(qg, keys, values).reshape(-1)
                continue
            qg = (
                q[s:e]
                .view(n, kv_heads, groups, head_dim)
                .permute(1, 2, 0, 3)
                .reshape(1, kv_heads, groups * n, head_dim)
            )
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
            out[s:e] = o.reshape(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(n, -1)
        return out


def _chunk_masks(
    chunks: Sequence[SeqChunk], groups: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor | None]:
    """Additive attention masks [groups * n, past + n] per chunk, built once per forward and shared by
    all layers (None for a single token: it sees the whole cache)."""
    masks: list[torch.Tensor | None] = []
    for chunk in chunks:
        n, past = chunk.end - chunk.start, chunk.cache.length
        if n == 1:
            masks.append(None)
            continue
        key_pos = torch.arange(past + n, device=device)
        query_pos = torch.arange(past, past + n, device=device)
        allowed = (key_pos[None, :] <= query_pos[:, None]).repeat(groups, 1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        masks.append(mask)
    return masks


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight `LlamaModel.from_weights` takes, with its expected shape (HF order, [out, in])."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.hidden_size), "norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm"] = (c.hidden_size,)
        shapes[p + "q"] = (q_size, c.hidden_size)
        shapes[p + "k"] = (kv_size, c.hidden_size)
        shapes[p + "v"] = (kv_size, c.hidden_size)
        if c.attention_bias:
            shapes.update({p + "q_bias": (q_size,), p + "k_bias": (kv_size,), p + "v_bias": (kv_size,)})
        shapes[p + "o"] = (c.hidden_size, q_size)
        if c.attention_out_bias:
            shapes[p + "o_bias"] = (c.hidden_size,)
        shapes[p + "mlp_norm"] = (c.hidden_size,)
        shapes[p + "gate"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "up"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "down"] = (c.hidden_size, c.intermediate_size)
    return shapes


def missing_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Names `LlamaModel.from_weights` needs that `weights` lacks."""
    return [n for n in weight_shapes(config) if n not in weights]
