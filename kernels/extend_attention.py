"""Paged extend attention: a chunk of new tokens over its cached prefix and itself.

Request ``i`` brings ``extend_lens[i]`` new tokens at positions
``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1``; their K/V are already in the
pool (the backend stores them first), so the whole context is
``req_to_token[req_rows[i], :prefix_lens[i] + extend_lens[i]]`` and one loop over it
with the causal rule ``key_pos <= query_pos`` covers both the prefix (always visible)
and the chunk (causal), in a single online softmax.

One program per (request, query head, BLOCK_M query tokens). The query tile is a
matrix, so both products run on tensor cores; keys past the tile's last query position
are never loaded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import INTERPRET, dot, dot_options, jit, next_pow2, tl, triton


class ExtendLaunch(NamedTuple):
    """Launch settings of :func:`extend_attention`: query/key tile rows and warps."""

    block_m: int
    block_n: int
    num_warps: int


def extend_launch_settings(arch: int | None, dtype: torch.dtype, head_dim: int) -> ExtendLaunch:
    """The tiles and warps extend attention launches with on CUDA arch ``arch`` (e.g. 80,
    90; None: no GPU, the interpreter) for K/V of ``dtype`` at ``head_dim``.

    From ptxas on sm_80 and sm_90a (benchmarks/gpu_compile_check.py; a sweep of BLOCK_M
    32/64/128 x BLOCK_N 32/64 x 4/8 warps):

    - sm_90 with 16-bit K/V: BLOCK_M=64, one warpgroup's rows, is the smallest tile on
      Hopper's wgmma (BLOCK_M=32 stays on mma.sync), without spills at 4 warps (head_dim
      64) or 8 (128); BLOCK_M=128 with 4 warps spills at head_dim 128.
    - otherwise BLOCK_M=32, as before (on sm_80 a larger tile changes no instruction;
      it stays on mma.sync). fp32 (``ieee`` dots: no MMA, whole tiles in registers)
      spills at BLOCK_M=64 with BLOCK_N=64 even with 8 warps. A ``[BLOCK_M, 128]`` fp32
      accumulator plus the q/k/v tiles (and fp32 tiles at any head_dim) spill with 4
      warps, so 8 warps halve each thread's share there.
    """
    wide = head_dim > 64 or dtype == torch.float32
    if arch is not None and arch >= 90 and dtype in (torch.bfloat16, torch.float16):
        return ExtendLaunch(64, 64, 8 if wide else 4)
    return ExtendLaunch(32, 64, 8 if wide else 4)


def _current_arch() -> int | None:
    """The CUDA arch Triton compiles for now (its active driver's target: the current
    device, or the target of a compile-only driver); None under the interpreter."""
    if INTERPRET:
        return None
    target = triton.runtime.driver.active.get_current_target()
    return target.arch if target.backend == "cuda" and isinstance(target.arch, int) else None


def extend_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Pure-torch reference, one request at a time, softmax in fp32. ``sliding_window``
    W > 0: a query at position p sees keys p - W + 1 .. p only.

    q: [sum(extend_lens), heads, dim], requests back to back; k_buffer, v_buffer:
    [num_slots, kv_heads, dim]; req_to_token: [rows, max_context]; req_rows,
    prefix_lens, extend_lens: [E]. Returns [sum(extend_lens), heads, dim] in q's dtype.
    """
    num_heads, kv_heads = q.shape[1], k_buffer.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    start = 0
    for i in range(req_rows.numel()):
        prefix, n = int(prefix_lens[i]), int(extend_lens[i])
        slots = req_to_token[int(req_rows[i]), : prefix + n].long()
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [L, heads, dim]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q[start : start + n].float(), k) * scale  # [heads, n, L]
        q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        k_pos = torch.arange(prefix + n, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + n] = torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
        start += n
    return out


@jit
def _extend_kernel(
    Q, Out, K_buf, V_buf, Req_to_token, Req_rows, Prefix_lens, Extend_lens, Start_loc,
    scale,
    window,  # sliding window (0: none): a query at p sees keys p - window + 1 .. p
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # grid: (E, heads, cdiv(max extend len, BLOCK_M))
    i = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = h // GROUP

    n_new = tl.load(Extend_lens + i)
    if m_block * BLOCK_M < n_new:  # programs past this request's chunk do nothing
        prefix = tl.load(Prefix_lens + i)
        first_tok = tl.load(Start_loc + i)
        row = tl.load(Req_rows + i).to(tl.int64)

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # index inside the chunk
        mask_m = offs_m < n_new
        q_pos = prefix + offs_m  # absolute positions of the query tile
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM

        # q: [BLOCK_M, BLOCK_D]; padded rows load as 0 and are never stored.
        q = tl.load(
            Q + (first_tok + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        q = q.to(K_buf.dtype.element_ty)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Keys up to the tile's last valid query position; position 0 is visible to every
        # row (padded rows too: q_pos >= 0), so m_i is finite after block 0.
        kv_end = prefix + tl.minimum((m_block + 1) * BLOCK_M, n_new)
        # With a window, keys start at the tile's first query's window, and a row whose
        # window starts later sees nothing in the first blocks: m_safe keeps its
        # all-masked blocks from producing inf - inf.
        kv_start = tl.where(window > 0, tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0), 0)
        lowest = tl.where(window > 0, q_pos - window, -1)  # keys at or below are outside the window
        for n0 in range(kv_start, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_end
            slots = tl.load(Req_to_token + row * stride_table + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_buf + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            qk = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale  # [BLOCK_M, BLOCK_N]
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])  # prefix + causal
            visible = visible & (offs_n[None, :] > lowest[:, None])
            qk = tl.where(visible, qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])
            v = tl.load(V_buf + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        tl.store(
            Out + (first_tok + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(Out.dtype.element_ty),  # padded rows: l_i may be 0
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    max_extend_len: int | None = None,
    extend_start_loc: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Triton paged extend attention; same contract as :func:`extend_attention_ref`.

    ``max_extend_len`` (the grid's third dimension) and ``extend_start_loc`` ([E] int32,
    offsets of each request's first token in q) are computed from ``extend_lens`` when not
    given; a caller that already has them on the host saves a device sync. ``out``
    ([sum(extend_lens), heads, dim], may be a view) receives the result. ``block_m``,
    ``block_n`` and ``num_warps`` default to :func:`extend_launch_settings` for the
    current target.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    if out is None:
        out = torch.empty_like(q)
    num_reqs = req_rows.numel()
    if num_reqs == 0 or num_tokens == 0:
        return out
    for t in (q, k_buffer, v_buffer, out):
        if t.stride(-1) != 1:
            raise ValueError("extend_attention needs a contiguous last (head_dim) dimension")
    extend_lens = extend_lens.to(torch.int32)
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens

    shipped = extend_launch_settings(_current_arch(), k_buffer.dtype, head_dim)
    block_m = block_m or shipped.block_m
    block_n = block_n or shipped.block_n
    num_warps = num_warps or shipped.num_warps
    grid = (num_reqs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_buffer, v_buffer, req_to_token, req_rows,
        prefix_lens.to(torch.int32), extend_lens, extend_start_loc.to(torch.int32),
        scale,
        sliding_window,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, **dot_options(k_buffer.dtype), num_warps=num_warps,
    )
    return out
