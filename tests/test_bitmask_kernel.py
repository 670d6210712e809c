"""The packed-bitmask kernel (kernels/bitmask.py) against an independent unpacking of the
allowed tokens, its torch reference and the CPU path of apply_grammar_masks; and the
device path of apply_grammar_masks (staging + kernel) against its CPU path.

Runs on CPU under the Triton interpreter (set before anything imports triton, as in
test_kernels_attention.py), on CUDA compiled.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: F401, E402

from plait.kernels.bitmask import apply_token_bitmask_inplace, apply_token_bitmask_ref  # noqa: E402
from plait.runtime.constrained import mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed(allowed: np.ndarray) -> np.ndarray:
    """bool [R, n] -> int32 [R, ceil(n / 32)], bit i % 32 of word i // 32 = column i."""
    pad = -allowed.shape[1] % 32
    return np.packbits(np.pad(allowed, ((0, 0), (0, pad))), axis=1, bitorder="little").view(np.int32)


def random_case(rng: np.random.Generator, num_rows: int, mask_vocab: int, density: float) -> np.ndarray:
    """Allowed tokens [num_rows, mask_vocab]: random, plus an all-blocked row and an
    all-allowed row when there are enough rows."""
    allowed = rng.random((num_rows, mask_vocab)) < density
    if num_rows >= 3:
        allowed[1] = False
        allowed[2] = True
    return allowed


def expected(logits: torch.Tensor, allowed: np.ndarray, rows: list[int]) -> torch.Tensor:
    """Independent of any unpacking code: mask rows r apply to logits rows rows[r];
    tokens past the mask are blocked."""
    out = logits.clone()
    vocab = logits.shape[1]
    for r, row in enumerate(rows):
        keep = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, allowed.shape[1])
        keep[:n] = torch.from_numpy(allowed[r, :n])
        out[row, ~keep.to(out.device)] = float("-inf")
    return out


# (logits width V, grammar vocabulary): odd widths, V = 32k + 1, a mask wider than the
# logits (bits past V ignored) and logits wider than the mask (tokens past it blocked)
VOCABS = [(1000, 1000), (32 * 37 + 1, 32 * 37 + 1), (4096, 4096), (700, 1000), (1100, 1000), (3000, 64)]


@pytest.mark.parametrize("vocab,mask_vocab", VOCABS)
@pytest.mark.parametrize("subset", [False, True])
def test_kernel_matches_reference(vocab: int, mask_vocab: int, subset: bool) -> None:
    rng = np.random.default_rng(vocab + mask_vocab + subset)
    batch = 7
    rows = [0, 2, 3, 6] if subset else list(range(batch))
    allowed = random_case(rng, len(rows), mask_vocab, density=0.3)
    bitmask = torch.from_numpy(packed(allowed)).to(DEVICE)
    logits = torch.randn(batch, vocab, device=DEVICE)
    want = expected(logits, allowed, rows)
    idx = torch.tensor(rows, device=DEVICE) if subset else None

    got = logits.clone()
    apply_token_bitmask_inplace(got, bitmask, idx)
    assert torch.equal(got, want)
    ref = logits.clone()
    apply_token_bitmask_ref(ref, bitmask, idx)
    assert torch.equal(ref, want)
    # the CPU path of apply_grammar_masks is the same rule
    host = logits.cpu()
    mask._apply_on_host(host, list(packed(allowed)), rows)
    assert torch.equal(host, want.cpu())
    if subset:  # rows without a mask are untouched
        free = [r for r in range(batch) if r not in rows]
        assert torch.equal(got[free], logits[free])
    if len(rows) >= 3:
        assert torch.isinf(got[rows[1]]).all()  # the all-blocked row
        assert torch.equal(got[rows[2], :mask_vocab], logits[rows[2], :mask_vocab])  # the all-allowed row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_logits_and_strided_rows(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(5)
    allowed = random_case(rng, 3, 2050, density=0.5)
    big = torch.randn(3, 2100, device=DEVICE).to(dtype)
    logits = big[:, :2050]  # row stride 2100
    want = expected(logits, allowed, [0, 1, 2])
    apply_token_bitmask_inplace(logits, torch.from_numpy(packed(allowed)).to(DEVICE))
    assert torch.equal(logits, want)
    assert not torch.isinf(big[:, 2050:]).any()  # nothing past the view's width


def test_kernel_rejects_bad_arguments() -> None:
    logits = torch.zeros(2, 64, device=DEVICE)
    words = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_inplace(logits, words.long())
    with pytest.raises(ValueError, match="pass rows"):
        apply_token_bitmask_inplace(logits, words[:1])
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_inplace(logits, words, torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="logits"):
        apply_token_bitmask_inplace(logits.long(), words)


class FakeGrammar:
    """What apply_grammar_masks reads of a request's grammar: its packed next-token mask."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = words

    def allowed(self, eos_ok: bool) -> np.ndarray:
        return self.words


class FakeReq:
    def __init__(self, grammar: FakeGrammar | None) -> None:
        self.grammar = grammar
        self.params = type("P", (), {"ignore_eos": False})()


@pytest.mark.parametrize("constrained", [[0, 1, 2, 3], [1, 3], [2]])
def test_device_path_of_apply_grammar_masks_matches_cpu_path(constrained: list[int]) -> None:
    rng = np.random.default_rng(len(constrained))
    vocab = 32 * 40 + 7
    allowed = random_case(rng, len(constrained), vocab, density=0.2)
    words = packed(allowed)
    grammars = iter(FakeGrammar(w) for w in words)
    reqs = [FakeReq(next(grammars) if i in constrained else None) for i in range(4)]
    logits = torch.randn(4, vocab)
    want = expected(logits, allowed, constrained)

    host = logits.clone()
    mask.apply_grammar_masks(host, reqs)  # CPU tensors: the numpy path
    assert torch.equal(host, want)
    dev = logits.to(DEVICE)
    mask._apply_with_kernel(dev, [r.grammar.allowed(True) for r in reqs if r.grammar], constrained)
    assert torch.equal(dev.cpu(), want)
    if DEVICE == "cuda":  # on CUDA the public entry takes the kernel path
        dev = logits.to(DEVICE)
        mask.apply_grammar_masks(dev, reqs)
        assert torch.equal(dev.cpu(), want)
