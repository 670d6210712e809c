"""plait.kernels: Triton kernels for the GPU path, each with a pure-torch reference.

Importing this package never requires a GPU or a compiler; Triton is imported lazily
by the modules that need it (through ``_triton``, which also picks the Triton
interpreter on machines without CUDA).

Modules (``*_ref`` is the torch reference beside each kernel):

- ``decode_attention``: paged split-KV decode attention, GQA-aware.
- ``extend_attention``: paged prefill / chunked-prefill attention over a cached prefix.
- ``kv_store``: write new K/V into pool slots.
- ``rmsnorm``: RMSNorm and residual-add + RMSNorm.
- ``rotary``: RoPE (HF ``rotate_half`` layout); ``compute_inv_freq`` and
  ``rope_cos_sin_cache`` are plain torch (default / linear / llama3 scaling) and import
  no Triton.
- ``activation``: SiLU-and-mul over a fused ``[gate | up]`` input.
- ``fused_moe``: mixture-of-experts experts as two grouped GEMMs over (token, expert)
  pairs sorted by expert (its reference: the grouped torch path of
  ``plait.runtime.models.moe``).
"""
