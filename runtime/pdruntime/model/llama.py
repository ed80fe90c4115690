"""Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Weights use the HF ``LlamaForCausalLM`` layout (rotate-half RoPE), with Q/K/V and gate/up fused
into one matmul each. Two first-class entry points:

* :meth:`LlamaModel.prefill` - one sequence, a chunk of ``T`` prompt tokens starting at ``start_pos``;
  the chunk's K/V is written into the cache and attention covers the cached prefix plus the chunk.
* :meth:`LlamaModel.decode`  - one new token for each of ``B`` sequences; K/V written at ``slots``,
  attention through the paged decode-attention kernel (``pdruntime.kernels``) or a torch fallback.

KV layout (shared with kernels/ and the PD transfer code): ``k[layer]: [num_blocks, BLOCK, Hkv, D]``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .parallel import TPShard, all_reduce_fn, shard_config

DecodeAttention = Callable[..., torch.Tensor]


def gguf_int4_tensors(cfg: LlamaConfig, tensors) -> tuple[list[str], str]:
    """The tensors :meth:`LlamaModel.load_gguf_int4` takes blocks from: every layer's Linear weights, and the output
    head's (the file's own ``lm_head``, or the embedding when tied or when the file stores no head)."""
    linears = [f"model.layers.{n}.{x}.weight" for n in range(cfg.num_layers) for x in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in tensors
    return linears, "model.embed_tokens.weight" if tied else "lm_head.weight"


class PrefillChunk(NamedTuple):
    token_ids: torch.Tensor  # [T] int64, positions start_pos .. start_pos + T - 1
    start_pos: int
    block_ids: torch.Tensor  # [>= ceil((start_pos + T) / BLOCK)] int64, the sequence's pages in order


def _torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                            sm_scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Reference paged decode attention. q: [B, Hq, D]; caches: [N, BLOCK, Hkv, D];
    block_table: [B, max_blocks] int32; seq_lens: [B] int32 (tokens incl. the new one) -> [B, Hq, D]."""
    bsz, hq, d = q.shape
    block = k_cache.shape[1]
    hkv = k_cache.shape[2]
    max_len = int(seq_lens.max())
    nb = (max_len + block - 1) // block
    idx = block_table[:, :nb].long()
    k = k_cache[idx].reshape(bsz, nb * block, hkv, d)  # [B, L, Hkv, D]
    v = v_cache[idx].reshape(bsz, nb * block, hkv, d)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.view(bsz, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k).mul_(scale)  # [B, Hkv, G, L]
    pad = torch.arange(nb * block, device=q.device)[None, :] >= seq_lens.to(q.device)[:, None].long()
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(bsz, hq, d)


def resolve_decode_attention(device: torch.device | str = "cpu", env=None) -> tuple[DecodeAttention, str]:
    """Pick the decode-attention implementation for the engine's ``device``:
    ``pdruntime.kernels.decode_attention`` (Triton on CUDA, its torch path on CPU, or what
    PDRT_ATTENTION_BACKEND forces) when importable, else the local reference. The backend follows the
    device it is given, never what the host has (``torch.cuda.is_available()``).

    Returns (callable bound to that kernel configuration, backend name for /config)."""
    try:
        from pdruntime.kernels.decode_attention import configure, decode_attention
    except ImportError:
        return _torch_decode_attention, "torch-fallback(engine)"
    try:
        cfg = configure(env, device)
    except Exception as exc:  # noqa: BLE001 - a bad PDRT_* knob must fail loudly, not fall back
        raise RuntimeError(f"decode attention cannot be configured: {exc}") from exc
    return functools.partial(decode_attention, config=cfg), f"kernels.decode_attention[{cfg.backend}]"


def rope_cos_sin(cfg: LlamaConfig, max_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, D] in fp32, HF rotate-half convention (freqs duplicated)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    scaling = dict(cfg.rope_scaling or ())
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif scaling.get("rope_type") == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    pos = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin_signed: [T, 1, D] -> RoPE(x), rotate-half convention.

    rotate_half(x) * sin == roll(x, D/2) * sin_signed with sin_signed = [-sin[:D/2], sin[D/2:]]."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, eps_t: torch.Tensor) -> torch.Tensor:
    """x: [B, H] -> RMSNorm(x) * weight. eps_t: [1, 1] tensor holding eps, in x's dtype and device.

    One fp32 row takes 4 ops (addmm, rsqrt_, mul, mul_) instead of F.rms_norm's ~8 ATen ops on CPU:
    mean(x^2) + eps is x @ x.T / H + eps in one addmm. Other shapes and dtypes use F.rms_norm."""
    h = x.shape[-1]
    if x.shape[0] != 1 or x.dtype != torch.float32:
        return F.rms_norm(x, (h,), weight, eps)
    inv_rms = torch.addmm(eps_t, x, x.t(), alpha=1.0 / h).rsqrt_()  # [1, 1]
    return torch.mul(x, inv_rms).mul_(weight)


def _linear_fn(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's forward minus the nn.Module call machinery (~20 us per call on the CPU decode path).

    Plain bias-free Linear -> F.linear on its weight; torch's dynamic int8 Linear -> its fbgemm op on the
    packed weight, exactly as its forward calls it (reduce_range=True, fp32 in and out). Anything else: the
    module itself."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    if type(mod).__name__ == "QuantLinear":  # pdruntime.kernels.cpu.quant (imported only with int4 weights)
        return mod.forward
    if type(mod) is QLinear and mod._packed_params.dtype == torch.qint8 and (mod.version or 0) >= 4:
        packed, op = mod._packed_params._packed_params, torch.ops.quantized.linear_dynamic
        return lambda x: op(x, packed, True)
    if type(mod) in (_Linear, nn.Linear) and mod.bias is None:
        weight = mod.weight
        return lambda x: F.linear(x, weight)
    return mod


def _reduced(fn: Callable[[torch.Tensor], torch.Tensor],
             all_reduce: Callable[[torch.Tensor], None] | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn, followed by an in-place all-reduce of its output when the model is a TP shard (else fn itself)."""
    if all_reduce is None:
        return fn

    def run(x: torch.Tensor) -> torch.Tensor:
        out = fn(x)
        all_reduce(out)
        return out

    return run


class _DecodeLayer(NamedTuple):
    """One layer's weights as the decode step calls them (built once per set of weights)."""

    input_norm: torch.Tensor  # [H]
    qkv: Callable[[torch.Tensor], torch.Tensor]  # [B, H] -> [B, (Hq + 2 Hkv) * D]
    o: Callable[[torch.Tensor], torch.Tensor]  # [B, Hq * D] -> [B, H]
    post_norm: torch.Tensor  # [H]
    gate_up: Callable[[torch.Tensor], torch.Tensor]  # [B, H] -> [B, 2 I]
    down: Callable[[torch.Tensor], torch.Tensor]  # [B, I] -> [B, H]


class _Linear(nn.Linear):
    """nn.Linear without the random init: weights are always loaded from a checkpoint."""

    def reset_parameters(self) -> None:
        pass


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        h = cfg.hidden_size
        kw = {"dtype": dtype, "device": device}
        self.input_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.qkv = _Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=False, **kw)
        self.o = _Linear(cfg.q_size, h, bias=False, **kw)
        self.gate_up = _Linear(h, 2 * cfg.intermediate_size, bias=False, **kw)
        self.down = _Linear(cfg.intermediate_size, h, bias=False, **kw)
        for p in self.parameters():
            p.requires_grad_(False)


class LlamaModel(nn.Module):
    """Inference-only Llama. All parameters are frozen; call under ``torch.inference_mode()``.

    ``device`` and ``dtype`` come from the engine configuration; parameters are allocated there and
    filled tensor by tensor (:meth:`load_hf_state`). With ``tp`` the model is one rank's shard:
    ``config`` is the per-rank architecture (heads, KV heads, MLP width divided by the TP size),
    ``full_config`` the checkpoint's, and o/down outputs are summed over the group."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TPShard | None = None) -> None:
        super().__init__()
        self.full_config = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        cfg = shard_config(cfg, tp.size) if self.tp is not None else cfg
        self.config = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self._all_reduce = all_reduce_fn(self.tp)
        kw = {"dtype": dtype, "device": self.device}
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, dtype, self.device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.lm_head = _Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **kw)
        self.lm_head.weight.requires_grad_(False)
        cos, sin = rope_cos_sin(cfg, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos.to(**kw), persistent=False)  # [max_pos, D]
        half = cfg.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("rope_sin", sin_signed.to(**kw), persistent=False)  # [max_pos, D], sign-folded
        # rope_swap[k, j] = 1 where k == (j - D/2) mod D: x @ rope_swap == roll(x, D/2) (decode's RoPE matrix)
        d = cfg.head_dim
        swap = torch.zeros(d, d, dtype=dtype)
        swap[(torch.arange(d) - half) % d, torch.arange(d)] = 1
        self.register_buffer("rope_swap", swap.to(self.device), persistent=False)  # [D, D]
        self.register_buffer("rms_eps", torch.full((1, 1), cfg.rms_norm_eps, **kw), persistent=False)
        self._decode_layers: tuple[list[_DecodeLayer], Callable] | None = None  # built by the first decode after (re)loading
        self._int4_decoder = None  # int4 weights: model/int4_decode.Int4Decoder, built by the first decode
        self.decode_attention: DecodeAttention = _torch_decode_attention
        self.attention_backend = "torch-fallback(engine)"
        self.weight_format = str(dtype).replace("torch.", "")

    # -- weights -------------------------------------------------------------------------------
    def load_hf_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-layout tensors (``model.layers.N.self_attn.q_proj.weight`` ...) into the fused layout.

        Tensor by tensor: each is read (``tensors`` may load lazily), cut to this rank's shard, converted
        to the model's dtype and copied to its device, so the host never holds more than one layer's
        tensors in the target dtype (no full fp32 copy of a large model)."""
        full, cfg = self.full_config, self.config
        rank = self.tp.rank if self.tp is not None else 0

        def take(name: str, shape: Sequence[int], dim: int | None = None, part: int = 0) -> torch.Tensor:
            """The tensor, checked against its full shape; with ``dim``, this rank's ``part``-wide slice."""
            if name not in tensors:
                from .config import ModelLoadError
                raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
            t = tensors[name]
            if tuple(t.shape) != tuple(shape):
                from .config import ModelLoadError
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            if dim is not None and part != shape[dim]:
                t = t.narrow(dim, rank * part, part)
            return t.to(self.dtype)

        h, i_full, i_sz = full.hidden_size, full.intermediate_size, cfg.intermediate_size
        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight", (full.vocab_size, h)))
            self.norm.copy_(take("model.norm.weight", (h,)))
            if full.tie_word_embeddings or "lm_head.weight" not in tensors:
                self.lm_head.weight = self.embed  # tied: one tensor
            else:
                self.lm_head.weight.copy_(take("lm_head.weight", (full.vocab_size, h)))
            for n, layer in enumerate(self.layers):
                p = f"model.layers.{n}."
                layer.input_norm.copy_(take(p + "input_layernorm.weight", (h,)))
                layer.post_norm.copy_(take(p + "post_attention_layernorm.weight", (h,)))
                layer.qkv.weight.copy_(torch.cat([
                    take(p + "self_attn.q_proj.weight", (full.q_size, h), 0, cfg.q_size),
                    take(p + "self_attn.k_proj.weight", (full.kv_size, h), 0, cfg.kv_size),
                    take(p + "self_attn.v_proj.weight", (full.kv_size, h), 0, cfg.kv_size),
                ]))
                layer.o.weight.copy_(take(p + "self_attn.o_proj.weight", (h, full.q_size), 1, cfg.q_size))
                layer.gate_up.weight.copy_(torch.cat([
                    take(p + "mlp.gate_proj.weight", (i_full, h), 0, i_sz),
                    take(p + "mlp.up_proj.weight", (i_full, h), 0, i_sz),
                ]))
                layer.down.weight.copy_(take(p + "mlp.down_proj.weight", (h, i_full), 1, i_sz))
        self._decode_layers = self._int4_decoder = None

    def quantize_int8(self) -> None:
        """Opt-in: int8 dynamic-quantised Linear layers (fbgemm on x86). Changes numerics; fp32 only."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError(f"int8 weights need an fp32 model on cpu, got {self.dtype} on {self.device}")
        from torch.ao.nn.quantized.dynamic import Linear as QLinear

        def q(lin: nn.Linear) -> nn.Module:
            qlin = QLinear(lin.in_features, lin.out_features, bias_=False, dtype=torch.qint8)
            w = torch.quantize_per_channel(lin.weight.detach().float().contiguous(),
                                           scales=lin.weight.abs().amax(dim=1).clamp_min(1e-8).double() / 127.0,
                                           zero_points=torch.zeros(lin.out_features, dtype=torch.int64),
                                           axis=0, dtype=torch.qint8)
            qlin.set_weight_bias(w, None)
            return qlin

        import warnings

        with warnings.catch_warnings():  # torch marks quantised tensor creation deprecated; fbgemm still serves it
            warnings.simplefilter("ignore", UserWarning)
            for layer in self.layers:
                layer.qkv, layer.o = q(layer.qkv), q(layer.o)
                layer.gate_up, layer.down = q(layer.gate_up), q(layer.down)
            self.lm_head = q(self.lm_head)
        self.weight_format = "int8-dynamic"
        self._decode_layers = None

    def quantize_int4(self) -> None:
        """Opt-in: 4-bit weights on the CPU, run by pdstack's native kernels (``pdruntime.kernels.cpu``).

        Every Linear layer becomes Q4_1 blocks and the output head Q8_0: the formats the embedded GGUF stores
        them in, so its own blocks come back. Decode (few rows) reads 5 bits a weight and quantises activations
        per block of 32 to 16-bit integers (fp32's next-token choices); prefill dequantises each weight for
        torch's matmul. The
        embedding lookup keeps its fp32 table. fp32 models on the CPU only; raises ValueError otherwise, and
        ``NativeUnavailable`` (saying why) where the kernels cannot be built."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError(f"int4 weights need an fp32 model on cpu, got {self.dtype} on {self.device}")
        from pdruntime.kernels.cpu.quant import Q4_1, Q8_0, QuantLinear

        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, QuantLinear.from_weight(getattr(layer, name).weight, Q4_1))
        self.lm_head = QuantLinear.from_weight(self.lm_head.weight, Q8_0)
        self.weight_format = "int4"
        self._decode_layers = self._int4_decoder = None

    def load_gguf_int4(self, tensors) -> None:
        """int4 straight from a GGUF file's own blocks, none dequantised and quantised again (the same blocks as
        :meth:`quantize_int4` gets back, at a fraction of the start-up cost). ``tensors``: the file's lazy
        mapping (``gguf_loader._LazyGGUF``): fp32 tensors by name for the norms and the embedding table, and
        ``blocks(name)`` / ``type_of(name)`` for every Linear weight (Q4_1) and the head (Q4_1 or Q8_0). One rank."""
        from pdruntime.kernels.cpu.quant import QuantLinear

        if self.tp is not None:
            raise ValueError("load_gguf_int4 loads a whole model; a TP shard takes load_hf_state + quantize_int4")
        full = self.full_config
        h, inter = full.hidden_size, full.intermediate_size

        def linear(names: Sequence[str], shape: tuple[int, int]) -> QuantLinear:
            types = {tensors.type_of(n) for n in names}
            if len(types) != 1:
                raise ValueError(f"{', '.join(names)} are stored as {', '.join(sorted(types))}; one layer needs one type")
            raws = [tensors.blocks(n) for n in names]
            ql = QuantLinear.from_gguf(types.pop(), raws[0] if len(raws) == 1 else np.concatenate(raws))
            if (ql.out_features, ql.in_features) != shape:
                raise ValueError(f"{names[0]} holds {ql.out_features} x {ql.in_features} weights, expected {shape}")
            return ql

        with torch.no_grad():
            self.embed.copy_(tensors["model.embed_tokens.weight"])
            self.norm.copy_(tensors["model.norm.weight"])
            for n, layer in enumerate(self.layers):
                p = f"model.layers.{n}."
                layer.input_norm.copy_(tensors[p + "input_layernorm.weight"])
                layer.post_norm.copy_(tensors[p + "post_attention_layernorm.weight"])
                layer.qkv = linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"], (full.q_size + 2 * full.kv_size, h))
                layer.o = linear([p + "self_attn.o_proj.weight"], (h, full.q_size))
                layer.gate_up = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], (2 * inter, h))
                layer.down = linear([p + "mlp.down_proj.weight"], (h, inter))
        self.lm_head = linear([gguf_int4_tensors(full, tensors)[1]], (full.vocab_size, h))
        self.weight_format = "int4"
        self._decode_layers = self._int4_decoder = None

    # -- forward -------------------------------------------------------------------------------
    def _mlp(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        gu = layer.gate_up(F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.config.rms_norm_eps))
        g, u = gu.chunk(2, dim=-1)
        out = layer.down(F.silu(g) * u)
        if self._all_reduce is not None:
            self._all_reduce(out)  # row-parallel down: sum the ranks' partial outputs
        return out

    def _attn_out(self, layer: LlamaLayer, attn: torch.Tensor) -> torch.Tensor:
        out = layer.o(attn)
        if self._all_reduce is not None:
            self._all_reduce(out)  # row-parallel o: sum the ranks' partial outputs
        return out

    def _qkv(self, layer: LlamaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, H] -> q [T, Hq, D], k/v [T, Hkv, D] with RoPE applied to q and k (in one op chain)."""
        cfg = self.config
        qkv = layer.qkv(F.rms_norm(x, (x.shape[-1],), layer.input_norm, cfg.rms_norm_eps))
        t = x.shape[0]
        qk = _rotate(qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim),
                     cos, sin)
        q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)
        return q, k, qkv[:, cfg.q_size + cfg.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> fp32 logits [N, V]."""
        h = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.config.rms_norm_eps)
        return self.lm_head(h).float()

    def prefill(self, token_ids: torch.Tensor, start_pos: int, k_cache: Sequence[torch.Tensor],
                v_cache: Sequence[torch.Tensor], block_ids: torch.Tensor, *, all_logits: bool = False) -> torch.Tensor:
        """One sequence's prompt chunk. token_ids: [T] int64 at positions start_pos..start_pos+T-1;
        block_ids: [>= ceil((start_pos+T)/BLOCK)] int64, the sequence's pages in order.
        Returns fp32 logits of the last token [V] (or of all T tokens [T, V] with all_logits)."""
        out = self.prefill_batch([PrefillChunk(token_ids, start_pos, block_ids)], k_cache, v_cache,
                                 all_logits=all_logits)
        return out[0]

    def prefill_batch(self, chunks: Sequence["PrefillChunk"], k_cache: Sequence[torch.Tensor],
                      v_cache: Sequence[torch.Tensor], *, all_logits: bool = False) -> list[torch.Tensor]:
        """Prompt chunks of several sequences in one forward: the matmuls run once over all their tokens
        (one pass over the weights), attention runs per chunk over its own cached prefix + the chunk.
        Returns per chunk the fp32 logits of its last token [V] (all tokens [T, V] with all_logits)."""
        cfg = self.config
        dev = self.device
        block = k_cache[0].shape[1]
        hkv, d = cfg.num_kv_heads, cfg.head_dim
        plans = []  # (row offset, T, start, ctx pages or None, mask or None)
        slots, pos_all, row = [], [], 0
        for c in chunks:
            t = int(c.token_ids.shape[0])
            end = c.start_pos + t
            pos = torch.arange(c.start_pos, end)
            slots.append(c.block_ids[pos // block] * block + pos % block)  # [T] flat cache rows
            pos_all.append(pos)
            if c.start_pos == 0:
                plans.append((row, t, end, None, None))
            else:  # queries at start_pos+i see keys 0..start_pos+i, partly cached by earlier chunks
                pages = c.block_ids[: (end + block - 1) // block].to(dev)
                plans.append((row, t, end, pages, (torch.arange(end)[None, :] <= pos[:, None]).to(dev)))
            row += t
        slot = torch.cat(slots).to(dev)
        positions = torch.cat(pos_all).to(dev)
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        x = self.embed[torch.cat([c.token_ids for c in chunks]).to(dev)]
        for n, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            kc, vc = k_cache[n], v_cache[n]
            kc.view(-1, hkv, d).index_copy_(0, slot, k)
            vc.view(-1, hkv, d).index_copy_(0, slot, v)
            outs = []
            for off, t, end, pages, mask in plans:
                if pages is None:
                    kk, vv = k[off: off + t], v[off: off + t]
                else:
                    kk = kc[pages].reshape(-1, hkv, d)[:end]
                    vv = vc[pages].reshape(-1, hkv, d)[:end]
                attn = F.scaled_dot_product_attention(
                    q[off: off + t].transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                    attn_mask=mask, is_causal=mask is None, enable_gqa=True)  # [1, Hq, T, D]
                outs.append(attn[0].transpose(0, 1).reshape(t, cfg.q_size))
            x = x + self._attn_out(layer, outs[0] if len(outs) == 1 else torch.cat(outs))
            x = x + self._mlp(layer, x)
        if all_logits:
            return [self.logits(x[off: off + t]) for off, t, *_ in plans]
        last = torch.tensor([off + t - 1 for off, t, *_ in plans], device=dev)
        return list(self.logits(x[last]).unbind(0))

    def _decode_weights(self) -> tuple[list[_DecodeLayer], Callable[[torch.Tensor], torch.Tensor]]:
        """(per-layer decode weights, lm_head fn), built once after the weights are loaded or quantised."""
        if self._decode_layers is None:
            red = self._all_reduce
            layers = [_DecodeLayer(l.input_norm, _linear_fn(l.qkv), _reduced(_linear_fn(l.o), red),
                                   l.post_norm, _linear_fn(l.gate_up), _reduced(_linear_fn(l.down), red))
                      for l in self.layers]
            self._decode_layers = (layers, _linear_fn(self.lm_head))
        return self._decode_layers

    def _rope_rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [B] int64 -> R: [B, D, D] with x @ R == RoPE(x) for one head row x: [D] at that position.

        R = diag(cos) + rope_swap * sin_signed: out[j] = x[j] cos[j] + x[(j - D/2) mod D] sin_signed[j], the
        rotate-half formula of ``_rotate`` as one bmm per layer instead of roll + mul + addcmul."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, D]
        return torch.diag_embed(cos).addcmul_(self.rope_swap, sin[:, None, :])

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, k_cache: Sequence[torch.Tensor],
               v_cache: Sequence[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor, *,
               attn_plan=None) -> torch.Tensor:
        """One token per sequence. token_ids/positions: [B] int64; block_table: [B, max_blocks] int32;
        seq_lens: [B] int32 = positions + 1, all on the model's device. Returns fp32 logits [B, V].
        attn_plan: a prebuilt split plan for the Triton kernel (CUDA graphs: no host reads in the step).

        Everything that is the same for all layers (cache slots, RoPE matrix) is built once per step."""
        cfg = self.config
        bsz = token_ids.shape[0]
        block = k_cache[0].shape[1]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pos = positions
        slots = block_table.long().gather(1, (pos // block)[:, None])[:, 0] * block + pos % block  # [B]
        attend = self.decode_attention if attn_plan is None else functools.partial(self.decode_attention, plan=attn_plan)
        if self.weight_format == "int4" and self.tp is None:
            return self._decode_int4(token_ids, positions, k_cache, v_cache, block_table, seq_lens, slots, attend)
        rope = self._rope_rotation(pos)  # [B, D, D]
        eps, eps_t = cfg.rms_norm_eps, self.rms_eps
        layers, lm_head = self._decode_weights()
        x = self.embed[token_ids]  # [B, H], a fresh tensor: the residual adds below run in place
        for n, layer in enumerate(layers):
            qkv = layer.qkv(_rms_norm_rows(x, layer.input_norm, eps, eps_t)).view(bsz, hq + 2 * hkv, d)
            qk = torch.bmm(qkv[:, : hq + hkv], rope)  # [B, Hq + Hkv, D], RoPE applied to q and k
            kc, vc = k_cache[n], v_cache[n]
            kc.view(-1, hkv, d).index_copy_(0, slots, qk[:, hq:])
            vc.view(-1, hkv, d).index_copy_(0, slots, qkv[:, hq + hkv:])
            attn = attend(qk[:, :hq].contiguous(), kc, vc, block_table, seq_lens)  # [B, Hq, D]
            x.add_(layer.o(attn.reshape(bsz, cfg.q_size)))
            gu = layer.gate_up(_rms_norm_rows(x, layer.post_norm, eps, eps_t))  # [B, 2 I]
            x.add_(layer.down(F.silu(gu[:, : cfg.intermediate_size]).mul_(gu[:, cfg.intermediate_size:])))
        return lm_head(_rms_norm_rows(x, self.norm, eps, eps_t)).float()

    def _decode_int4(self, token_ids: torch.Tensor, positions: torch.Tensor, k_cache: Sequence[torch.Tensor],
                     v_cache: Sequence[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                     slots: torch.Tensor, attend: DecodeAttention) -> torch.Tensor:
        """:meth:`decode` with int4 weights: six native calls a layer (``model/int4_decode.py``)."""
        from .int4_decode import DecodeBatch, Int4Decoder

        if self._int4_decoder is None:
            self._int4_decoder = Int4Decoder(self)
        return self._int4_decoder.step(DecodeBatch(token_ids, positions, slots, block_table, seq_lens), k_cache,
                                       v_cache, attend, native_attention=self.attention_backend.endswith("[cpu]"))
