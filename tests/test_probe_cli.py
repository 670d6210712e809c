"""``plait serve`` takes the launch commands SGLang and vLLM users type.

Each common flag of ``python -m sglang.launch_server`` and ``vllm serve`` either works
with SGLang's / vLLM's meaning, is accepted where it changes nothing, or is refused with
an argparse-style error naming it (never a traceback). Parsing-level tests drive the
real parser (:func:`add_server_arguments` + :func:`args_from_namespace`, as ``plait
serve`` does), no server is started.
"""

from __future__ import annotations

import argparse
import pytest

from plait.cli import main as cli_main
from plait.runtime.server.args import ServerArgs, add_server_arguments, args_from_namespace


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, default_port=30000)
    return args_from_namespace(parser.parse_args(list(argv)))


def serve_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The error ``plait serve ARGV`` exits with, before anything starts."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


SGLANG_COMMAND = ("--model-path", "/models/x", "--port", "30000", "--host", "0.0.0.0", "--tp", "2",
                  "--mem-fraction-static", "0.8", "--context-length", "4096", "--served-model-name", "x",
                  "--api-key", "k", "--max-running-requests", "8", "--chunked-prefill-size", "512",
                  "--disable-radix-cache", "--schedule-policy", "lpm", "--log-level", "warning", "--trust-remote-code",
                  "--dtype", "bfloat16", "--random-seed", "1", "--enable-metrics", "--tool-call-parser", "qwen25",
                  "--reasoning-parser", "qwen3", "--kv-cache-dtype", "auto", "--quantization", "none")


def test_an_sglang_launch_command_keeps_its_meaning():
    a = parse(*SGLANG_COMMAND)
    e = a.engine
    assert (a.model, a.port, a.host, a.served_model_name, a.api_key, a.log_level) == \
        ("/models/x", 30000, "0.0.0.0", "x", "k", "warning")
    assert (e.tp_size, e.mem_fraction_static, e.context_length, e.max_running_requests, e.chunked_prefill_size) == \
        (2, 0.8, 4096, 8, 512)
    assert (e.disable_radix_cache, e.schedule_policy, e.dtype, e.seed) == (True, "lpm", "bfloat16", 1)
    # SGLang's qwen25 (and qwen) parse <tool_call> blocks: plait's hermes; its llama3 is llama3_json
    assert (a.tool_call_parser, a.reasoning_parser) == ("hermes", "qwen3")
    assert parse("--tool-call-parser", "qwen").tool_call_parser == "hermes"
    assert parse("--tool-call-parser", "llama3").tool_call_parser == "llama3_json"
    # Python's level names in any case, critical included
    assert parse("--log-level", "WARNING").log_level == "warning"
    assert parse("--log-level", "critical").log_level == "critical"


def test_a_vllm_serve_command_keeps_its_meaning():
    a = parse("/models/x", "--port", "8000", "--max-model-len", "2048", "--max-num-seqs", "64",
              "--max-num-batched-tokens", "1024", "--block-size", "32", "--enforce-eager", "--enable-prefix-caching",
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
              "--guided-decoding-backend", "guidance", "--seed", "3", "--uvicorn-log-level", "info", "-tp", "2",
              "--scheduling-policy", "fcfs", "--disable-log-requests", "--disable-log-stats")
    e = a.engine
    assert (a.model, a.port, a.tool_call_parser, a.reasoning_parser, a.log_level_http) == \
        ("/models/x", 8000, "hermes", "deepseek-r1", "info")
    assert (e.context_length, e.max_running_requests, e.chunked_prefill_size, e.page_size) == (2048, 64, 1024, 32)
    assert (e.disable_cuda_graph, e.disable_radix_cache, e.grammar_backend, e.seed, e.tp_size, e.schedule_policy) == \
        (True, False, "llguidance", 3, 2, "fcfs")
    assert parse("--no-enable-prefix-caching").engine.disable_radix_cache is True
    assert parse("/models/x", "--model", "/models/x").model == "/models/x"


def test_gpu_memory_utilization_is_the_memory_fraction_on_cuda_and_ignored_on_cpu():
    assert parse("--device", "cuda", "--gpu-memory-utilization", "0.5").engine.mem_fraction_static == 0.5
    # on CPU mem_fraction_static is a share of RAM; vLLM's GPU share must not size it
    assert parse("--device", "cpu", "--gpu-memory-utilization", "0.9").engine.mem_fraction_static is None


def test_a_flag_given_twice_or_with_equals_takes_the_last_value():
    assert parse("--port=31000").port == 31000
    assert parse("--port", "1", "--port", "2").port == 2
    assert parse("--tp=2").engine.tp_size == 2


@pytest.mark.parametrize("argv, named", [
    (("--grammar-backend", "xgrammar"), "grammar_backend='xgrammar' is not available in plait"),
    (("--guided-decoding-backend", "xgrammar"), "grammar_backend='xgrammar' is not available in plait"),
    (("--grammar-backend", "none"), "grammar_backend='none' is not available in plait"),
    (("--tool-call-parser", "kimi_k2"), "tool_call_parser='kimi_k2'"),
    (("/models/a", "--model", "/models/b"), "the model was given twice"),
    (("--enable-prefix-caching", "--disable-radix-cache"), "disable_radix_cache and enable_prefix_caching"),
    (("--device", "cuda", "--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.5"),
     "mem_fraction_static and gpu_memory_utilization"),
    (("--no-enable-chunked-prefill",), "enable_chunked_prefill=False is not supported by plait"),
    (("-pp", "2"), "pp_size=2 is not supported by plait"),
    (("--tokenizer", "/elsewhere"), "tokenizer_path='/elsewhere' is not supported by plait"),
    (("--port", "-1"), "port=-1"),
    (("--tp", "0"), "tp_size=0"),
    (("--schedule-policy", "lof"), "schedule_policy='lof'"),
    (("--context-length", "abc"), "argument --context-length/--max-model-len: invalid int value"),
    (("--log-level", "trace"), "argument --log-level: invalid choice"),
])
def test_what_plait_cannot_honour_is_refused_by_name(capsys, argv, named):
    line = serve_error(capsys, *argv)
    assert line.startswith("plait serve: error: ") and named in line


def test_the_error_is_not_buried_under_the_usage_of_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--tp", "0"])
    assert len(capsys.readouterr().err.strip().splitlines()) == 2  # usage: plait serve [MODEL] [options], error


def test_python_m_server_errors_the_same_way(capsys):
    from plait.runtime.server.__main__ import main as server_main

    with pytest.raises(SystemExit) as exc:
        server_main(["--port", "-1"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("python -m plait.runtime.server: error: ") and "port=-1" in line


def test_keywords_take_the_same_names_as_the_flags():
    """launch(), Runtime and Engine share the table: vLLM's names work as keywords."""
    a = ServerArgs.from_kwargs(None, device="cpu", max_num_seqs=8, enable_prefix_caching=False,
                               gpu_memory_utilization=0.9, tool_call_parser="qwen25", uvicorn_log_level="trace")
    assert (a.engine.max_running_requests, a.engine.disable_radix_cache, a.engine.mem_fraction_static) == \
        (8, True, None)
    assert (a.tool_call_parser, a.log_level_http) == ("hermes", "trace")
    with pytest.raises(ValueError, match="enable_prefix_caching='no' is invalid; allowed: True or False"):
        ServerArgs.from_kwargs(None, enable_prefix_caching="no")
    with pytest.raises(ValueError, match="served_model_name=.* is invalid; allowed: a non-empty name"):
        ServerArgs.from_kwargs(None, served_model_name=["a", "a"])
    with pytest.raises(ValueError, match="served_model_name=.* is invalid"):
        ServerArgs.from_kwargs(None, served_model_name=[])


def test_several_served_names_are_aliases():
    """vLLM's --served-model-name a b: a request may send either name, responses and the
    first card carry the first, /v1/models lists both."""
    from types import SimpleNamespace

    from plait.errors import RequestError
    from plait.runtime.server import openai_api as oa

    a = parse("--served-model-name", "first", "second")
    assert (a.model_name, a.model_names) == ("first", ["first", "second"])
    assert ServerArgs.from_kwargs(None, served_model_name=("x", "y")).model_names == ["x", "y"]
    assert ServerArgs.from_kwargs(None, served_model_name=["only"]).served_model_name == "only"
    front = SimpleNamespace(args=a)
    assert [oa.check_model(front, {"model": m}) for m in ("first", "second", "default")] == ["first"] * 3
    with pytest.raises(RequestError, match="'first', 'second'") as e:
        oa.check_model(front, {"model": "third"})
    assert e.value.status == 404


def test_stopping_an_engine_that_is_not_connected_leaves_no_stray_error():
    """Shutting down after a process-group SIGTERM (systemd, ``timeout``) killed the
    engine: the shutdown message cannot be sent (no peer) and that is all; the failed
    send used to be left in a future whose error asyncio logged with a traceback."""
    import asyncio
    import gc

    import zmq
    import zmq.asyncio

    from plait.runtime.server.serve import _stop_engine

    class GoneEngine:  # still running at the first look, gone at the next
        def __init__(self) -> None:
            self.looks = 0

        def poll(self) -> int | None:
            self.looks += 1
            return None if self.looks == 1 else -15

        def wait(self) -> int:
            return -15

    errors: list[dict] = []

    async def stop() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.bind("inproc://engine-in")
        await _stop_engine(push, GoneEngine())
        push.close(linger=0)
        ctx.term()
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(stop())
    assert errors == []


@pytest.mark.parametrize("argv,named", [
    (["--max-new-tokens", "-5"], "max_new_tokens=-5 is invalid"),
    (["--temperature", "-1"], "temperature=-1.0 is invalid"),
    (["--num-threads", "0"], "num_threads=0 is invalid"),
    (["--model", "/nonexistent/model"], "'/nonexistent/model' does not exist"),
])
def test_plait_generate_errors_are_one_line_not_a_traceback(capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "hi", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and err.strip().splitlines()[-1].startswith("plait generate: error:")


def test_plait_serve_says_a_start_up_error_once():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from plait.cli import main; raise SystemExit(main())", "serve",
                           "--model", "/nonexistent/model", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "'/nonexistent/model' does not exist" in line]
    # named once in the line, and no Python-API spelling (model_path=) in a command-line error
    assert len(errors) == 1 and errors[0].startswith("error: model path '/nonexistent/model'"), proc.stderr
    assert errors[0].count("/nonexistent/model") == 1 and "model_path=" not in errors[0], proc.stderr


def test_options_are_not_abbreviated_and_errors_carry_the_subcommands_usage(capsys):
    """``--prot`` is not taken for ``--protocol`` (an abbreviation accepted today becomes
    ambiguous when an option is added), and an unknown option is reported by ``plait
    serve`` with its own usage, not the top-level ``plait {generate,serve,lint}`` one."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--max-running", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: plait serve [MODEL] [options]" in err and "unrecognized arguments: --max-running" in err, err
    assert "{generate,serve,lint}" not in err and "--help lists them" not in err
    with pytest.raises(SystemExit):
        cli_main(["generate", "hi", "--max-new", "3"])
    err = capsys.readouterr().err
    assert "usage: plait generate" in err and "unrecognized arguments: --max-new 3" in err, err


def test_dp_with_tp_and_one_rendezvous_address_is_refused_before_start(capsys):
    """dp_size 2 x tp_size 2 with --dist-init-addr: both replicas' ranks would listen on
    that port; the second failed ~10 s into start-up with EADDRINUSE."""
    err = serve_error(capsys, "--dp-size", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:29555")
    assert "dist_init_addr='127.0.0.1:29555' is invalid with dp_size=2" in err, err
    parse("--dp-size", "2", "--tp-size", "2")  # without it, each group finds a port of its own
    parse("--tp-size", "2", "--dist-init-addr", "127.0.0.1:29555")
