"""benchmarks/bench_batched.py reads llama-batched-bench's result table by its header."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_batched import Row, parse_batched_bench  # noqa: E402

# the shape of llama-batched-bench's output: log lines, a settings line, then the table
OUTPUT = """\
llama_model_loader: loaded meta data with 30 key-value pairs
main: n_kv_max = 8448, n_batch = 2048, n_ubatch = 512, flash_attn = 0, n_threads = 2
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.650 |   196.92 |    1.300 |    98.46 |    1.950 |   131.28 |
|   128 |    128 |    8 |   2048 |    4.450 |   230.11 |    6.800 |   150.59 |   11.250 |   182.04 |

llama_perf_context_print:        load time =     120.00 ms
"""


def test_rows_by_batch():
    rows = parse_batched_bench(OUTPUT)
    assert rows == {1: Row(1, 196.92, 98.46), 8: Row(8, 230.11, 150.59)}


def test_columns_are_found_by_name():
    # another build may add or move columns: the header decides
    text = """\
| B | S_TG t/s | PP | S_PP t/s | extra |
|---|---|---|---|---|
| 32 | 170.5 | 128 | 206.25 | x |
"""
    assert parse_batched_bench(text) == {32: Row(32, 206.25, 170.5)}


def test_no_table_is_an_error():
    with pytest.raises(ValueError, match="no llama-batched-bench result table"):
        parse_batched_bench("error: failed to load model '/nope.gguf'\n| a | b |\n")
