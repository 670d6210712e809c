"""Steps of a decoder on CPU in one native call: quantized projections (``quantization``
int8/q4) or float32 ones on the native GEMM (``cpu_gemm`` native, ``none``).

At batch 1 a quantized decode step spends about as long outside its GEMMs as in them:
~25 torch operations and ctypes calls per layer (norms, rotary, the K/V store, SiLU, the
kernel wrappers, ``nn.Module`` dispatch), each a few microseconds to tens of
microseconds on this CPU (torch's RMSNorm of one 576-wide row: ~15 us). A
:class:`FusedDecoder` runs the whole stack of layers for a step in
``plait_fused_decode_f32`` (``kernels/quant_linear_cpu.c``) instead: the same
projections on the same q4/q8 kernel or native float32 GEMM (called from C through its
function pointer), attention on the native kernel (``plait_paged_extend_f32``, also
through its pointer), and the small per-token work in C. One Python -> C call per step;
the embedding lookup and the LM head stay in torch.

Steps with prompt chunks take it too, beside decodes or alone: each token is a query row
attending to its request's context up to its own position, a chunk's tokens in tiles of
16 that read the context once per tile. Measured on the 2-core Xeon (SmolLM2-135M
float32, 8 greedy streams): a decode-only step 39 -> 29 ms, a step of 24 prompt tokens
beside them 67 -> 55 ms early in a 2048-token prompt (README). Whole prompts too: on the
2-core Zen 4 (SmolLM2-135M float32, 2 threads) a 2048-token prompt in one step takes
3.05-3.2 s against 3.6-3.9 s on the module path (whose one masked SDPA call per layer is
1.24 s of it), a 512-token one 0.59-0.66 s against 0.72 s; with torch and the kernels
held to AVX2, 3.27-3.40 s against 3.59-3.69 s and 0.60-0.67 s against 0.71-0.74 s.
Quantized models take chunks of fewer than :data:`plait.runtime.models.quant.PACK_MIN_ROWS`
rows: from there the module path packs the dequantized weights for oneDNN's GEMM, faster
than the kernel's panels (q4, 2048 tokens on the Zen 4: 3.53-3.82 s fused against
3.64-3.81 s; 512 tokens 0.69 against 0.76-0.79 s).

Not bit for bit the module path (float32 sums of the norms and SiLU in another order,
the attention's own exp): tests check the same greedy tokens and logprobs within 1e-3 on
tiny models of each family it takes and on the default model, and the engine's
exactness tests against Hugging Face run with it on. ``fused_decode=False`` keeps every
step on the torch modules.

Used only where it does the same computation: a Llama-family decoder (RMSNorm, SiLU MLP,
no q/k norms, sandwich norms, embedding scale, mixture-of-experts or sliding-window
layers), every projection quantized on an x86 kernel or float32 packed for the native
GEMM, the native CPU attention backend, one process (no tensor parallelism), and steps of
as many rows as a quantized kernel takes (``quant.kernel_takes``).
:func:`why_not` says why a model is not eligible; the engine option ``fused_decode``
turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from plait.kernels import cpu_attention, gemm_cpu, quant_cpu
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.linear import Linear
from plait.runtime.models.quant import PACK_MIN_ROWS, QuantLinear, kernel_takes

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# a fused step's scratch buffers (all layers' activations of every row, held at once):
# steps whose rows would need more take the module path (SmolLM2-135M: ~32 KB a row,
# ~33k rows; a 1B Llama ~143 KB a row, ~7.5k rows)
MAX_STEP_BUFFER_BYTES = 1 << 30


class _QWeight(ctypes.Structure):
    _fields_ = [("kind", _int), ("N", _i64), ("K", _i64), ("qs", _p), ("scales", _p), ("mins", _p), ("bias", _p)]


class _QLayer(ctypes.Structure):
    _fields_ = [("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("input_norm", _p), ("post_norm", _p), ("k_buf", _p), ("v_buf", _p)]


class _Step(ctypes.Structure):
    _fields_ = [("B", _i64), ("hidden", _i64), ("H", _i64), ("KVH", _i64), ("D", _i64), ("inter", _i64),
                ("eps", _f32), ("scale", _f32), ("cos_sin", _p), ("positions", _p), ("slots", _p), ("table", _p),
                ("table_stride", _i64), ("req_rows", _p), ("seq_lens", _p), ("final_norm", _p),
                ("x", _p), ("residual", _p), ("xn", _p), ("qkv", _p), ("attn", _p), ("gu", _p), ("act", _p),
                ("out", _p), ("gemm", _p), ("gemm_isa", _i64), ("gemm_prefetch_rows", _i64)]


def why_not(model: torch.nn.Module, attn: object) -> str | None:
    """Why ``model`` (a ``CausalLM``) with the attention backend ``attn`` cannot take the
    fused path, or None when it can."""
    from plait.runtime.attention.cpu_backend import CpuAttentionBackend

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "model") or getattr(model, "tp", None) is not None:
        return "not a single-process CausalLM"
    if not isinstance(attn, CpuAttentionBackend):
        return "the attention backend is not the native CPU one"
    if getattr(attn.pool, "window", None) is not None or any(w for w in cfg.layer_windows):
        return "sliding-window layers"
    if cfg.qk_norm or cfg.norm_unit_offset or cfg.sandwich_norms or cfg.scale_embeddings:
        return "q/k norms, Gemma norms or embedding scale"
    if cfg.hidden_act != "silu" or any(cfg.sparse_layers):
        return "not a SiLU MLP in every layer"
    if model.triton_ops:
        return "triton ops"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        projections = (a.qkv_proj, a.o_proj, getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None))
        if not all(_kind(p) is not None for p in projections):
            return "a projection is neither quantized on an x86 kernel nor float32 on the native GEMM"
    if attn.pool.dtype != torch.float32 or model.model.rotary.cos_sin_cache.dtype != torch.float32:
        return "not float32"
    layers = model.model.layers
    eps = {n.eps for la in layers for n in (la.input_layernorm, la.post_attention_layernorm)} | {model.model.norm.eps}
    if len(eps) != 1:
        return "RMSNorm epsilons differ between layers"
    return None


F32_PACKED = 100  # the C file's KIND_F32_PACKED


def _kind(p: object) -> str | None:
    """``quant`` (a quantized projection on an x86 kernel), ``f32`` (float32 packed for
    the native GEMM) or None (the fused path cannot run it)."""
    if type(p) is QuantLinear and p.isa != "portable":
        return "quant"
    if type(p) is Linear and isinstance(p.packed, gemm_cpu.Packed) and (p.bias is None or p.bias.dtype == torch.float32):
        return "f32"
    return None


def _weight(p: QuantLinear | Linear) -> _QWeight:
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    if _kind(p) == "f32":
        return _QWeight(F32_PACKED, p.out_features, p.in_features, p.packed.data.data_ptr(), None, None, ptr(p.bias))
    return _QWeight(quant_cpu.KINDS.index(p.kind), p.out_features, p.in_features, p.qs.data_ptr(),
                    p.scales.data_ptr(), ptr(p.mins), ptr(p.bias))


class FusedDecoder:
    """The fused decode path of one eligible model (:func:`why_not` is None) over its
    attention backend's pool; holds pointers to the model's weights and the pool's
    buffers, so it is built again when either is replaced."""

    def __init__(self, model: torch.nn.Module, attn: object) -> None:
        reason = why_not(model, attn)
        if reason is not None:
            raise ValueError(f"the fused decode path does not apply: {reason}")
        self.lib = quant_cpu.load()
        self.lib.plait_fused_decode_f32.restype = _int
        self.lib.plait_fused_decode_f32.argtypes = [_int, _p, _i64, _p, _p, _int]
        attention = cpu_attention.load()
        self.attend = ctypes.cast(attention.plait_paged_extend_f32, _p)
        self.model, self.attn = model, attn
        layers, pool = model.model.layers, attn.pool
        projections = [p for la in layers for p in (la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp.gate_up_proj,
                                                     la.mlp.down_proj)]
        quantized = [p for p in projections if _kind(p) == "quant"]
        # the quantized kernels' ISA (None: every projection is float32), and the native GEMM's
        self.isa_name = quantized[0].isa if quantized else None
        # (float32 models: the CPU's, for the vector paths of the per-token work such as the SiLU)
        self.isa = quant_cpu.ISAS.index(self.isa_name if quantized else quant_cpu.choose_isa())
        self.gemm, self.gemm_isa, self.gemm_prefetch_rows = None, 0, 0
        if len(quantized) < len(projections):
            gemm_isa = gemm_cpu.choose_isa()
            self.gemm = ctypes.cast(gemm_cpu.load().plait_gemm_f32, _p).value
            self.gemm_isa, self.gemm_prefetch_rows = gemm_cpu.ISAS[gemm_isa], gemm_cpu.PREFETCH_MIN_ROWS[gemm_isa]
        self.layers = (_QLayer * len(layers))(*[
            _QLayer(_weight(la.self_attn.qkv_proj), _weight(la.self_attn.o_proj), _weight(la.mlp.gate_up_proj),
                    _weight(la.mlp.down_proj), la.input_layernorm.weight.data_ptr(),
                    la.post_attention_layernorm.weight.data_ptr(), pool.k_buffers[i].data_ptr(),
                    pool.v_buffers[i].data_ptr())
            for i, la in enumerate(layers)
        ])
        self.eps = layers[0].input_layernorm.eps  # every norm's (why_not)
        # prompt chunks only where their tiles run on vector intrinsics (AVX-512, AVX2):
        # the portable tile is slower than the module path's SDPA; quantized weights up to
        # the rows from which the module path packs them for oneDNN (module docstring)
        cfg = model.config
        row_floats = (4 * cfg.hidden_size + (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                      + 3 * cfg.intermediate_size)
        self.max_extend = MAX_STEP_BUFFER_BYTES // (4 * row_floats) if attention.plait_paged_extend_vectorized() else 0
        self.max_rows = PACK_MIN_ROWS - 1 if quantized else None

    def applies(self, fb: ForwardBatch) -> bool:
        """Whether this step is one the fused path runs: decode rows and prefill chunks of
        at most ``max_extend`` tokens in all (none where the attention's tiles are not
        vectorized: ``plait_paged_extend_vectorized``; fewer than ``PACK_MIN_ROWS`` rows
        for quantized weights), as many rows as the kernels take."""
        rows = fb.num_decodes + sum(fb.extend_seq_lens)
        return (rows >= 1 and rows - fb.num_decodes <= self.max_extend and fb.windowed is None
                and (self.max_rows is None or rows <= self.max_rows)
                and (self.isa_name is None or kernel_takes(self.isa_name, rows)))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden states [T, hidden] of the step's tokens (:meth:`applies`),
        their K/V written into the pool, as ``CausalLM.forward`` returns them."""
        cfg, m = self.model.config, self.model.model
        hid, D, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        H, KVH = cfg.num_heads, cfg.num_kv_heads
        counts = [*fb.extend_seq_lens, *[1] * fb.num_decodes]
        B = sum(counts)
        x = m.embed_tokens(fb.input_ids).contiguous()
        bufs = {name: torch.empty((B, n), dtype=torch.float32) for name, n in (
            ("residual", hid), ("xn", hid), ("qkv", (H + 2 * KVH) * D), ("attn", H * D), ("gu", 2 * inter),
            ("act", inter), ("out", hid))}
        positions = fb.positions.to(torch.int64).contiguous()
        slots = fb.out_slots.to(torch.int64).contiguous()
        req_rows = fb.req_rows.to(torch.int64)
        if fb.num_extends:  # one attention row per token: its request's page-table row, its context length
            rows = torch.repeat_interleave(req_rows, torch.tensor(counts, dtype=torch.int64))
            lens = torch.tensor([p + j + 1 for p, n in zip(fb.extend_prefix_lens, fb.extend_seq_lens) for j in range(n)]
                                + list(fb.decode_seq_lens), dtype=torch.int64)
        else:
            rows, lens = req_rows.contiguous(), torch.tensor(fb.decode_seq_lens, dtype=torch.int64)
        table = fb.req_to_token
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError("the fused decode path needs a contiguous int32 page table")
        step = _Step(B, hid, H, KVH, D, inter, self.eps, self.attn.scale, m.rotary.cos_sin_cache.data_ptr(),
                     positions.data_ptr(), slots.data_ptr(), table.data_ptr(), table.stride(0), rows.data_ptr(),
                     lens.data_ptr(), m.norm.weight.data_ptr(), x.data_ptr(),
                     *(bufs[n].data_ptr() for n in ("residual", "xn", "qkv", "attn", "gu", "act", "out")),
                     self.gemm, self.gemm_isa, self.gemm_prefetch_rows)
        rc = self.lib.plait_fused_decode_f32(self.isa, ctypes.addressof(self.layers), len(self.layers),
                                             ctypes.addressof(step), self.attend, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the fused decode kernel rejected the model's shapes (rc {rc})")
        return bufs["out"]
