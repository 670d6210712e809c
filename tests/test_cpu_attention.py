"""The native CPU decode kernel (plait.kernels.cpu_attention) against the torch
reference, the `cpu` attention backend against the torch backend, and the engine's
choice of backend (including its fallback when the kernel cannot be built).

Tolerance: fp32, atol 2e-5 / rtol 1e-4 (the kernel sums in a different order and uses
its own exp, relative error < 1e-7)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from plait.kernels import cpu_attention
from plait.kernels.decode_attention import decode_attention_ref
from plait.runtime import Engine
from plait.runtime.attention.cpu_backend import CpuAttentionBackend
from plait.runtime.attention.torch_backend import TorchAttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import KVPool, PageAllocator, ReqToToken

TOL = dict(atol=2e-5, rtol=1e-4)


def paged_contexts(lens: list[int], page_size: int, kv_heads: int, head_dim: int, num_layers: int = 1, seed: int = 0):
    """A KVPool with random K/V and a page table whose requests' pages are shuffled and
    whose rows are scattered: (pool, table, rows)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_req) + 3
    pool = KVPool(num_pages * page_size, num_layers, kv_heads, head_dim, torch.float32, "cpu", page_size=page_size)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    alloc = PageAllocator(num_pages, page_size)
    pages = alloc.alloc(sum(pages_per_req))
    pages = [pages[i] for i in torch.randperm(len(pages), generator=gen).tolist()]
    table = ReqToToken(2 * len(lens) + 1, max(lens) + 8, "cpu")
    rows = list(range(2 * len(lens), 0, -2))[: len(lens)]
    for row, n, k in zip(rows, lens, pages_per_req):
        mine, pages = pages[:k], pages[k:]
        table.write(row, 0, alloc.pages_to_slots(mine)[:n])
    return pool, table.table, torch.tensor(rows, dtype=torch.int64)


@pytest.fixture
def two_threads():
    """The kernel runs on torch's thread count; 2 makes FEW split by head, MANY by request."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# one-token, short, block-boundary (64), page-boundary and long contexts; the kernel
# splits work by KV head for few requests and by request for many (>= 4 per thread)
FEW = [1, 5, 16, 64, 65, 131, 300]
MANY = FEW + [2, 33, 128, 129, 200, 17, 90, 250, 3]


@pytest.mark.parametrize("lens", [FEW, MANY], ids=["few", "many"])
@pytest.mark.parametrize("head_dim", [32, 40, 64, 128])  # 40: not a multiple of 16, the portable path
@pytest.mark.parametrize("gqa,kv_heads", [(1, 4), (3, 3), (8, 1), (16, 2)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_kernel_matches_reference(page_size, gqa, kv_heads, head_dim, lens, two_threads):
    pool, table, rows = paged_contexts(lens, page_size, kv_heads, head_dim, seed=page_size + gqa + head_dim)
    heads = gqa * kv_heads
    # q as rows of a fused projection output: strided between requests
    q = torch.randn(len(lens), heads + 2 * kv_heads, head_dim)[:, :heads]
    seq_lens = torch.tensor(lens)
    scale = head_dim**-0.5
    ref = decode_attention_ref(q, pool.k_buffers[0], pool.v_buffers[0], table, rows, seq_lens, scale)
    out = cpu_attention.paged_decode(q, pool.k_buffers[0], pool.v_buffers[0], table, rows, seq_lens, scale)
    torch.testing.assert_close(out, ref, **TOL)


def test_kernel_handles_extreme_scores():
    # large logits: the online softmax must rescale, not overflow
    pool, table, rows = paged_contexts([200], 16, 1, 64, seed=3)
    pool.k_buffers[0].mul_(30.0)
    q = torch.randn(1, 2, 64) * 30
    ref = decode_attention_ref(q, pool.k_buffers[0], pool.v_buffers[0], table, rows, torch.tensor([200]), 0.125)
    out = cpu_attention.paged_decode(q, pool.k_buffers[0], pool.v_buffers[0], table, rows, torch.tensor([200]), 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)


def test_kernel_rejects_what_it_cannot_run():
    pool, table, rows = paged_contexts([4], 1, 1, 64)
    with pytest.raises(ValueError, match="heads=17"):  # 17 query heads per KV head > MAX_GROUP
        cpu_attention.paged_decode(torch.randn(1, 17, 64), pool.k_buffers[0], pool.v_buffers[0], table, rows,
                                   torch.tensor([4]), 0.125)
    with pytest.raises(ValueError, match="dtype"):
        cpu_attention.paged_decode(torch.randn(1, 2, 64, dtype=torch.float64), pool.k_buffers[0], pool.v_buffers[0],
                                   table, rows, torch.tensor([4]), 0.125)
    bf16 = KVPool(16, 1, 1, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        CpuAttentionBackend(bf16, 2, 0.125)


@pytest.mark.parametrize("extends,decode_lens", [([(0, 7), (33, 12)], [1, 20, 77, 150]), ([], [3, 64, 200])])
def test_backend_matches_torch_backend(extends, decode_lens):
    kv_heads, heads, dim, layers = 3, 9, 64, 2
    lens = [p + n for p, n in extends] + decode_lens
    pool, table, rows = paged_contexts(lens, 16, kv_heads, dim, num_layers=layers, seed=7)
    positions, slots = [], []
    for row, (prefix, n) in zip(rows.tolist(), extends):
        positions += range(prefix, prefix + n)
        slots += table[row, prefix : prefix + n].tolist()
    for row, n in zip(rows.tolist()[len(extends) :], decode_lens):
        positions.append(n - 1)
        slots.append(int(table[row, n - 1]))
    fb = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=torch.tensor(positions),
        out_slots=torch.tensor(slots), req_rows=rows, req_to_token=table, num_extends=len(extends),
        extend_prefix_lens=[p for p, _ in extends], extend_seq_lens=[n for _, n in extends],
        decode_seq_lens=decode_lens,
    )
    reference, backend = TorchAttentionBackend(pool, heads, dim**-0.5), CpuAttentionBackend(pool, heads, dim**-0.5)
    fb_ref, fb = fb.with_attn_metadata(reference.init_forward(fb)), fb.with_attn_metadata(backend.init_forward(fb))
    for layer in range(layers):
        q = torch.randn(fb.num_tokens, heads + 2 * kv_heads, dim)[:, :heads]
        kv = torch.randn(fb.num_tokens, 2 * kv_heads, dim)
        expected = reference.forward(q, kv[:, :kv_heads], kv[:, kv_heads:], layer, fb_ref)
        torch.testing.assert_close(backend.forward(q, kv[:, :kv_heads], kv[:, kv_heads:], layer, fb), expected, **TOL)


def test_engine_picks_cpu_backend_and_falls_back_without_compiler(tiny_model_factory, monkeypatch, tmp_path):
    folder = str(tiny_model_factory("llama"))
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = ["The quick brown fox", "Once upon a time in a land far away there lived"]
    with Engine(folder, kv_cache_tokens=512) as e:
        assert type(e.runner.attn) is CpuAttentionBackend
        native = e.generate(prompts, greedy)
    with Engine(folder, kv_cache_tokens=512, attention_backend="torch") as e:
        assert type(e.runner.attn) is TorchAttentionBackend
        reference = e.generate(prompts, greedy)
    assert [o["output_ids"] for o in native] == [o["output_ids"] for o in reference]

    # a machine where the kernel cannot be built (no compiler, nothing built before): auto
    # keeps the torch backend, an explicit request says why it cannot be met
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "_error", None)
    monkeypatch.setattr(cpu_attention, "_compiler", lambda: None)
    with Engine(folder, kv_cache_tokens=512) as e:
        assert type(e.runner.attn) is TorchAttentionBackend
        assert [o["output_ids"] for o in e.generate(prompts, greedy)] == [o["output_ids"] for o in reference]
    with pytest.raises(RuntimeError, match="no C compiler"):
        Engine(folder, kv_cache_tokens=512, attention_backend="cpu")


def test_build_is_cached_and_failures_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "_error", None)
    cpu_attention.load()
    built = list((tmp_path / "cache").glob("paged_decode_cpu-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_attention, "_lib", None)
    cpu_attention.load()  # a second process (or call) reuses the library
    assert built[0].stat().st_mtime_ns == mtime and len(list((tmp_path / "cache").iterdir())) == 1

    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "SOURCE", tmp_path / "broken.c")
    (tmp_path / "broken.c").write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="compiling the CPU decode kernel failed"):
        cpu_attention.load()
    with pytest.raises(RuntimeError, match="unavailable"):  # remembered, not retried
        cpu_attention.load()


def test_a_changed_header_rebuilds_the_library(tmp_path, monkeypatch):
    """The cache key covers the headers a kernel includes (kernels/vexp.h): a library
    built before a header changed is not reused after."""
    import ctypes

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    cc = cpu_attention._compiler()
    src = tmp_path / "k.c"
    src.write_text('#include "k.h"\nint k_value(void) { return K_VALUE; }\n')
    built = []
    for value in (1, 2, 2):
        (tmp_path / "k.h").write_text(f"#define K_VALUE {value}\n")
        lib = cpu_attention._build(cc, src, (["-O1", "-fPIC", "-shared"],), "a test kernel")
        built.append(lib)
        assert ctypes.CDLL(str(lib)).k_value() == value
    assert built[0] != built[1] and built[1] == built[2]
    assert cpu_attention._local_headers(cpu_attention.SOURCE)  # the decode kernel includes vexp.h


def test_a_library_built_earlier_is_taken_without_a_compiler(tmp_path, monkeypatch):
    """An image that built its kernels and then dropped the compiler: the cache key held
    `cc --version`, so without a compiler nothing was found and the engine took torch's
    paths. Now a library built from the same source, flags and CPU is taken; another
    source is not, and the error says both what is missing and where it looked."""
    import ctypes

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    cc = cpu_attention._compiler()
    src = tmp_path / "k.c"
    src.write_text("int k_value(void) { return 7; }\n")
    flags = (["-O1", "-fPIC", "-shared"],)
    built = cpu_attention._build(cc, src, flags, "a test kernel")
    found = cpu_attention._build(None, src, flags, "a test kernel")
    assert found == built and ctypes.CDLL(str(found)).k_value() == 7
    src.write_text("int k_value(void) { return 8; }\n")
    with pytest.raises(RuntimeError, match="no C compiler found.*no library built earlier"):
        cpu_attention._build(None, src, flags, "a test kernel")
    with pytest.raises(RuntimeError, match="no library built earlier"):
        cpu_attention._build(None, src, (["-O2", "-fPIC", "-shared"],), "a test kernel")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISAs")
def test_max_isa_avx2_makes_every_native_kernel_choose_avx2(tmp_path):
    """PLAIT_MAX_ISA=avx2: the CPU's flags as the kernels see them lose AVX-512 and AMX, so
    the GEMMs choose their AVX2 paths and the attention kernel is built without AVX-512;
    another value is refused by name."""
    code = ("from plait.kernels import cpu_attention, gemm_cpu, quant_cpu\n"
            "f = cpu_attention._cpu_flags().split()\n"
            "assert not any(x.startswith(('avx512', 'amx')) for x in f), f\n"
            "print(gemm_cpu.choose_isa(), quant_cpu.choose_isa(), '-mno-avx512f' in cpu_attention._FLAG_SETS[0])")
    env = {**os.environ, "PLAIT_MAX_ISA": "avx2", "PLAIT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "avx2" in cpu_attention._cpu_flags().split():
        assert proc.stdout.split() == ["avx2", "avx2", "True"]
    env["PLAIT_MAX_ISA"] = "sse"
    proc = subprocess.run([sys.executable, "-c", "import plait.kernels.cpu_attention"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "PLAIT_MAX_ISA='sse'" in proc.stderr


def test_unwritable_cache_dir_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    monkeypatch.setattr(cpu_attention.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "_error", None)
    cpu_attention.load()
    assert list(tmp_path.glob("plait-cache-*/paged_decode_cpu-*.so"))


@pytest.mark.parametrize("gqa,kv_heads,head_dim", [(3, 3, 64), (1, 4, 128), (8, 1, 64), (16, 2, 32), (3, 3, 40)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiled_kernel_matches_reference_for_chunks_and_decodes(page_size, gqa, kv_heads, head_dim, two_threads):
    """The fused forward's attention: a step of prompt-chunk tokens (tiles of up to 16
    consecutive tokens of one request, each seeing the keys up to its own position) and
    decode tokens gives what one decode row per token gives. Chunks of 37 (tiles 16,
    16, 5), 20 from position 0, 1 (a single token), decodes between them; group 16
    (one token per tile) and head dim 40 take the per-token path."""
    ctx = [137, 20, 90, 64, 300, 1]  # context lengths after this step
    pool, table, rows = paged_contexts(ctx, page_size, kv_heads, head_dim, seed=gqa + head_dim)
    chunks = [(0, 37), (1, 20), (2, 1)]  # (request, tokens ending at its context length)
    tok_rows, tok_lens = [], []
    for req, n in chunks[:2]:
        tok_rows += [int(rows[req])] * n
        tok_lens += list(range(ctx[req] - n + 1, ctx[req] + 1))
    for req in (3, 2, 4, 5):  # decodes, one between chunks of another request
        tok_rows.append(int(rows[req]))
        tok_lens.append(ctx[req])
    heads = gqa * kv_heads
    q = torch.randn(len(tok_rows), heads + 2 * kv_heads, head_dim)[:, :heads]
    r, lens = torch.tensor(tok_rows), torch.tensor(tok_lens)
    scale = head_dim**-0.5
    ref = decode_attention_ref(q, pool.k_buffers[0], pool.v_buffers[0], table, r, lens, scale)
    out = cpu_attention.paged_decode(q, pool.k_buffers[0], pool.v_buffers[0], table, r, lens, scale, tiled=True)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("threads,chunks", [(2, ((0, 16),)), (4, ((0, 16), (1, 16)))])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiled_kernel_split_key_ranges_match_reference(page_size, threads, chunks):
    """Items fewer than keep the threads equally busy (one 16-token tile of a model with
    3 KV heads on 2 threads: 3 items; two tiles on 4 threads: 6) have their keys split
    into ranges computed apart and merged; the merge gives what one pass gives. Long
    contexts (past page and block boundaries), decodes beside the chunks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ctx = [1100, 600, 777, 5]
        pool, table, rows = paged_contexts(ctx, page_size, 3, 64, seed=threads)
        tok_rows, tok_lens = [], []
        for req, n in chunks:
            tok_rows += [int(rows[req])] * n
            tok_lens += list(range(ctx[req] - n + 1, ctx[req] + 1))
        for req in (2, 3):
            tok_rows.append(int(rows[req]))
            tok_lens.append(ctx[req])
        q = torch.randn(len(tok_rows), 9, 64)
        r, lens = torch.tensor(tok_rows), torch.tensor(tok_lens)
        ref = decode_attention_ref(q, pool.k_buffers[0], pool.v_buffers[0], table, r, lens, 0.125)
        out = cpu_attention.paged_decode(q, pool.k_buffers[0], pool.v_buffers[0], table, r, lens, 0.125, tiled=True)
        torch.testing.assert_close(out, ref, **TOL)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="haswell is an x86 target")
def test_tiled_kernel_built_for_avx2_matches_reference(tmp_path):
    """The kernel built as for an AVX2-only CPU (PLAIT_MAX_ISA=avx2: no AVX-512 intrinsics;
    the AVX2 tile with its key ranges, the portable decode path), in a fresh cache, gives
    the same results."""
    env = {**os.environ, "PLAIT_MAX_ISA": "avx2", "PLAIT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "tiled_kernel_matches_reference or split_key_ranges"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "14 passed" in proc.stdout
    assert any(p.name.startswith("paged_decode_cpu-") for p in tmp_path.rglob("*.so"))
