"""Weight-only quantization of the linear projections and the LM head (CPU in float32;
CUDA in the model's dtype, on the Triton kernel :mod:`plait.kernels.quant_gemm`).

``EngineConfig.quantization`` names the layout the weights are kept in; activations stay
float32 (but for one-row steps on AVX-512 VNNI and AVX2 CPUs, which round them to 16 bits
per block of 32: 2^-16 of the block's largest value) and the products run in
:mod:`plait.kernels.quant_cpu` (why that kernel and not torch's: README, Quantized
weights):

- ``none``: float32 weights (the exact reference path, :mod:`plait.runtime.models.linear`).
- ``int8``: every projection and the LM head in Q8 blocks: 32 int8 weights of one output
  row and a float32 scale, ``w = q * scale`` (GGUF Q8_0's math).
- ``q4``: every projection in Q4 blocks: 32 4-bit weights with a float32 scale and
  minimum, ``w = q * scale + min`` (GGUF Q4_1's math); the LM head in Q8 blocks, as
  llama.cpp's 4-bit files keep theirs at 6-8 bits (its error reaches the logits directly).

GGUF tensors whose blocks carry the same math are converted block by block, never
through float32 (float16 scales, and Q4_K's 6-bit sub-block scales times its float16
super-scales, are exact in float32): Q8_0 into Q8; Q4_0 / Q4_1 / Q4_K into Q4 — the
file's own weights, bit for bit. Everything else (Hugging Face floats, Q6_K, a Q4 tensor
asked for in Q8 ...) is quantized from float32, round to nearest. The tied LM head is
quantized from the float32 embedding table (which the lookup keeps). Embeddings, norms
and routed experts stay float32.

On AVX-512 the kernel takes any number of rows (many rows: dequantized panels in L1,
faster than dequantize + MKL's GEMM at every size measured); on the other paths steps
with more than :data:`KERNEL_MAX_ROWS` rows (long prefills) dequantize a weight into a
float32 matrix and run one BLAS GEMM, faster there than the kernel. From
:data:`PACK_MIN_ROWS` rows, where oneDNN is available, the dequantized weight is packed
for oneDNN's GEMM instead (the packing then pays for itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import quant_cpu
from plait.kernels.quant_cpu import BLOCK
from plait.runtime.models.linear import onednn_gemm_available, pack_weight, packed_linear

QUANTIZATIONS = ("none", "int8", "q4")
# per kernel path: steps with more rows than this go through dequantize + GEMM (None:
# never; measured: README). AVX2 / portable, q4, per 30 layers of SmolLM2 on the Zen 4
# (kernel vs dequantize + MKL): AVX2 32 rows 90 vs 97-101 ms, 48 rows 127 vs 111-115, 128
# rows 432 vs 236; portable 4 rows 116 vs 202, 8 rows 211 vs 195, 16 rows 448 vs 251
KERNEL_MAX_ROWS: dict[str, int | None] = {"avx512vnni": None, "avx512": None, "avx2": 32, "portable": 4}


# from this many rows a weight is dequantized and packed for oneDNN's GEMM each step: the
# packing pays for itself (AVX-512 EPYC Zen 4, per 30 layers of SmolLM2: 1024 rows 1186 ms
# vs 1344 on the kernel's panels, 2048 rows 2213 vs 2455; 512 rows 697 vs 704)
PACK_MIN_ROWS = 1024


def kernel_takes(isa: str, rows: int) -> bool:
    """Whether the kernel path ``isa`` multiplies ``rows`` rows itself."""
    limit = KERNEL_MAX_ROWS[isa]
    return limit is None or rows <= limit


@dataclass(frozen=True)
class QuantWeight:
    """A weight [rows, cols] in blocks of 32 along ``cols``: ``kind`` q8 (qs int8
    [rows, cols], scales [rows, cols/32]) or q4 (qs uint8 [rows, cols/2], scales and mins
    [rows, cols/32]); see the module docstring for the math."""

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The weight's rows ``index`` (a permutation or a slice)."""
        return QuantWeight(self.kind, self.qs[index], self.scales[index], None if self.mins is None else self.mins[index])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, computed in torch (the reference the kernel is tested against)."""
        rows, cols = self.shape
        s = self.scales[:, :, None]
        if self.kind == "q8":
            return (self.qs.view(rows, -1, BLOCK).float() * s).reshape(rows, cols)
        q = self.qs.view(rows, -1, BLOCK // 2)
        q = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # byte j: weight j (low), j + 16 (high)
        return torch.addcmul(self.mins[:, :, None], q, s).reshape(rows, cols)


def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """Round-to-nearest quantization of a float weight [rows, cols] (cols a multiple of 32):
    q8 symmetric (scale = max |w| / 127), q4 asymmetric (min and (max - min) / 15)."""
    rows, cols = w.shape
    if cols % BLOCK:
        raise ValueError(f"a quantized weight needs a multiple of {BLOCK} input features, got {cols}")
    b = w.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    if kind == "q8":
        scale = b.abs().amax(-1) / 127
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = (b * inv[:, :, None]).round().clamp(-127, 127).to(torch.int8)
        return QuantWeight("q8", q.reshape(rows, cols).contiguous(), scale.contiguous(), None)
    lo, hi = b.amin(-1), b.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((b - lo[:, :, None]) * inv[:, :, None]).round().clamp(0, 15).to(torch.uint8)
    packed = q[:, :, : BLOCK // 2] | (q[:, :, BLOCK // 2 :] << 4)
    return QuantWeight("q4", packed.reshape(rows, cols // 2).contiguous(), scale.contiguous(), lo.contiguous())


# --- GGUF blocks -------------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


GGUF_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")


def from_gguf(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantWeight:
    """A GGUF tensor's blocks (``data``: uint8 [rows, bytes per row]; ``type_name`` one of
    :data:`GGUF_BLOCK_TYPES`) as q8 (Q8_0) or q4 blocks with the same values."""
    nb = cols // BLOCK
    if type_name == "Q8_0":  # [d f16][32 x int8]
        blocks = np.asarray(data).reshape(rows, nb, 34)
        qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, cols)
        return QuantWeight("q8", torch.from_numpy(qs), torch.from_numpy(_f16(blocks[:, :, :2])), None)
    if type_name in ("Q4_0", "Q4_1"):  # [d f16]([m f16])[16 bytes: j low, j + 16 high]
        head = 2 if type_name == "Q4_0" else 4
        blocks = np.asarray(data).reshape(rows, nb, head + 16)
        d = _f16(blocks[:, :, :2])
        m = -8 * d if type_name == "Q4_0" else _f16(blocks[:, :, 2:4])  # (q - 8) d = q d + (-8 d), exact
        qs = np.ascontiguousarray(blocks[:, :, head:]).reshape(rows, cols // 2)
        return QuantWeight("q4", torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)))
    if type_name == "Q4_K":  # 256-weight super-blocks: [d][dmin][12 bytes 6-bit scales/mins][128 bytes]
        from gguf.quants import Q4_K

        blocks = np.asarray(data).reshape(-1, 144)
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale = (d[:, None] * sc.astype(np.float32)).reshape(rows, nb)
        minimum = (-(dmin[:, None] * mn.astype(np.float32))).reshape(rows, nb)
        # 4 chunks of 32 bytes; chunk i: low nibbles = sub-block 2i, high nibbles = 2i + 1
        raw = blocks[:, 16:].reshape(-1, 4, 1, 32)
        q = ((raw >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(rows, nb, BLOCK)
        packed = q[:, :, :16] | (q[:, :, 16:] << 4)
        return QuantWeight("q4", torch.from_numpy(np.ascontiguousarray(packed).reshape(rows, cols // 2)),
                           torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(np.ascontiguousarray(minimum)))
    raise ValueError(f"GGUF type {type_name} has no block counterpart; those that do: {', '.join(GGUF_BLOCK_TYPES)}")


# --- the layer -----------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """A linear layer whose weight is kept in :class:`QuantWeight` blocks of ``kind``
    (buffers ``qs``, ``scales`` float32 [out, in/32], ``mins`` for q4; the bias stays a
    float parameter), filled row range by row range with :meth:`load_rows`, as the fused
    projections are."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: str, isa: str) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(
                f"quantization needs the input features of every projection to be a multiple of {BLOCK}; "
                f"this model has a projection with {in_features}; use quantization='none'"
            )
        self.in_features, self.out_features, self.kind, self.isa = in_features, out_features, kind, isa
        nb = in_features // BLOCK
        q8 = kind == "q8"
        self.register_buffer("qs", torch.empty(out_features, in_features if q8 else in_features // 2,
                                               dtype=torch.int8 if q8 else torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, nb))
        self.register_buffer("mins", None if q8 else torch.empty(out_features, nb))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def numel(self) -> int:
        return self.in_features * self.out_features

    def weight(self) -> QuantWeight:
        return QuantWeight(self.kind, self.qs, self.scales, self.mins)

    def load_rows(self, tensor: torch.Tensor | QuantWeight, offset: int, rows: int) -> None:
        """Write rows ``offset .. offset + rows`` (rows 0: all) from blocks of this layer's
        kind as they are, or from a float tensor (quantized here) or other blocks (through
        float32)."""
        rows = rows or self.out_features
        if tuple(tensor.shape) != (rows, self.in_features):
            raise ValueError(f"a weight of shape {tuple(tensor.shape)} for rows {offset}..{offset + rows} of a "
                             f"[{self.out_features}, {self.in_features}] projection")
        if isinstance(tensor, QuantWeight) and tensor.kind != self.kind:
            tensor = tensor.dequantize()
        q = tensor if isinstance(tensor, QuantWeight) else quantize(tensor, self.kind)
        span = slice(offset, offset + rows)
        self.qs[span].copy_(q.qs)
        self.scales[span].copy_(q.scales)
        if self.mins is not None:
            self.mins[span].copy_(q.mins)

    def keep_float32_blocks(self) -> None:
        """Scales and minimums back in float32 after a cast of the model to a 16-bit
        dtype (``CausalLM.materialize``): the blocks' math is float32 on every device."""
        self.scales = self.scales.float()
        if self.mins is not None:
            self.mins = self.mins.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if x.is_cuda:  # the Triton kernel (activations in the model's dtype)
            from plait.kernels import quant_gemm

            return quant_gemm.quant_linear(x, self.kind, self.qs, self.scales, self.mins, self.bias)
        rows = x.shape[0]
        pack = rows >= PACK_MIN_ROWS and onednn_gemm_available()
        if not pack and kernel_takes(self.isa, rows):
            return quant_cpu.quant_linear(x.contiguous(), self.kind, self.qs, self.scales, self.mins, self.bias, self.isa)
        w = quant_cpu.dequantize(self.kind, self.qs, self.scales, self.mins, self.in_features, self.isa)
        return packed_linear(x.contiguous(), pack_weight(w), self.bias) if pack else F.linear(x, w, self.bias)


def quantize_projections(model: nn.Module, mode: str) -> None:
    """Replace every projection (``plait.runtime.models.linear.Linear``) under ``model``
    with an empty :class:`QuantLinear` in the layout ``mode`` names (the untied
    ``lm_head``: q8 in both modes). Call on the meta device, before the weights load."""
    from plait.runtime.models.linear import Linear

    isa, kind = quant_cpu.choose_isa(), {"int8": "q8", "q4": "q4"}[mode]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear:
                k = "q8" if parent is model and name == "lm_head" else kind
                setattr(parent, name, QuantLinear(child.in_features, child.out_features, child.bias is not None, k, isa))


def quantized_lm_head(embedding: torch.Tensor) -> QuantLinear:
    """The tied LM head in q8 blocks, from the float32 embedding table [vocab, hidden]."""
    vocab, hidden = embedding.shape
    head = QuantLinear(hidden, vocab, False, "q8", quant_cpu.choose_isa()).to(embedding.device)
    head.load_rows(embedding, 0, 0)
    return head


def describe(mode: str) -> dict[str, Any]:
    """What a benchmark prints about the quantized path on this machine."""
    return {"quantization": mode, "kernel_isa": quant_cpu.choose_isa(), "kernel_max_rows": KERNEL_MAX_ROWS[quant_cpu.choose_isa()]}
