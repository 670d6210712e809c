"""``chat_template`` / ``--chat-template`` (SGLang's and vLLM's option): a template file,
the template text or the built-in ``chatml`` replaces the model's chat template; anything
else is refused at start-up by name. One server on a raw base model (its tokenizer has no
chat template) shows /v1/chat/completions rendering with the given file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import openai
import pytest

from plait.chat_template import CHATML, jinja_render, load_chat_template
from plait.runtime import Engine
from plait.runtime.config import EngineConfig
from plait.runtime.server import launch
from plait.runtime.server.args import ServerArgs, add_server_arguments, args_from_namespace

from conftest import build_tiny_model

# a marker per role, so the rendered prompt shows whose template wrote it
MARKED = ("{% for m in messages %}[[{{ m['role'] | upper }}]] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[[REPLY]]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def template_file(tmp_path: Path) -> Path:
    path = tmp_path / "marked.jinja"
    path.write_text(MARKED)
    return path


# -- parsing and validation -----------------------------------------------------------------------
def test_keyword_takes_a_template_file(template_file):
    args = ServerArgs.from_kwargs("m", chat_template=str(template_file))
    assert args.engine.chat_template == str(template_file)
    assert args.engine.resolved_chat_template() == MARKED
    # rebuilt from JSON in the server process, the path still names the file
    again = ServerArgs.from_validated_json(args.to_json())
    assert again.engine.resolved_chat_template() == MARKED


def test_command_line_flag_takes_a_template_file(template_file):
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = args_from_namespace(parser.parse_args(["m", "--chat-template", str(template_file)]))
    assert args.engine.resolved_chat_template() == MARKED
    assert args_from_namespace(parser.parse_args(["m"])).engine.resolved_chat_template() is None


def test_template_text_and_the_chatml_name_are_taken():
    assert EngineConfig(chat_template=MARKED).resolved_chat_template() == MARKED
    chatml = EngineConfig(chat_template="chatml").resolved_chat_template()
    assert chatml == CHATML
    text = jinja_render(chatml, add_generation_prompt=True)(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_transformers_generation_block_compiles():
    # transformers' {% generation %} tag (assistant masks) is no error, and renders its body
    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}A:{{ m['content'] }}"
              "{% endgeneration %}{% else %}U:{{ m['content'] }}{% endif %}{% endfor %}")
    assert load_chat_template(source) == source
    assert jinja_render(source)([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]) == "U:xA:y"


@pytest.mark.parametrize("case, why", [
    ("missing", "no such file"),
    ("sglang_name", "no such file"),
    ("folder", "not a file"),
    ("json", "JSON files"),
    ("no_jinja", "holds no Jinja template"),
    ("syntax", "does not compile"),
    ("unknown_filter", "does not compile"),
    ("empty", "is invalid"),
])
def test_bad_values_are_refused_by_name(tmp_path, case, why):
    (tmp_path / "conv.json").write_text(json.dumps({"name": "x", "sep_style": "CHATML"}))
    (tmp_path / "plain.txt").write_text("no template here")
    value = {
        "missing": str(tmp_path / "nope.jinja"),
        "sglang_name": "llama-2",
        "folder": str(tmp_path),
        "json": str(tmp_path / "conv.json"),
        "no_jinja": str(tmp_path / "plain.txt"),
        "syntax": "{% for m in messages %}{{ m['content'] }}",
        "unknown_filter": "{{ messages | no_such_filter }}",
        "empty": "",
    }[case]
    with pytest.raises(ValueError) as err:
        ServerArgs.from_kwargs("m", chat_template=value)
    msg = str(err.value)
    assert msg.startswith("chat_template=") and "(--chat-template)" in msg and why in msg
    assert "allowed:" in msg and "chatml" in msg


def test_launch_refuses_a_missing_file_before_starting(tmp_path):
    with pytest.raises(ValueError, match="chat_template=.*no such file"):
        launch("m", chat_template=str(tmp_path / "nope.jinja"))


# -- a server on a model without a chat template ----------------------------------------------------
@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A tiny random llama whose tokenizer (byte-level, 256 bytes + an end token) has no
    chat template: a raw base model. Built here, not from SmolLM2's tokenizer (which
    has a template to remove and takes seconds to convert from its GGUF)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("base-model")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tok.save_pretrained(root / "tokenizer")
    assert len(tok) == 257 and not tok.chat_template
    return build_tiny_model(root / "model", root / "tokenizer", "llama", vocab_size=len(tok), bos_token_id=None,
                            eos_token_id=256, pad_token_id=256)


@pytest.fixture(scope="module")
def server(base_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "marked.jinja"
    path.write_text(MARKED)
    with launch(str(base_model), chat_template=str(path), num_threads=1, kv_cache_tokens=2048,
                max_running_requests=8) as rt:
        yield rt


def test_chat_on_a_base_model_renders_with_the_given_file(server, base_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model)
    assert not tok.chat_template  # without the option this model has no chat
    prompt = tok.apply_chat_template(MESSAGES, chat_template=MARKED, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("[[USER]] Name a colour.\n[[REPLY]]")
    ids = tok.encode(prompt, add_special_tokens=False)

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MESSAGES, max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ref = http.post("/generate", json={"input_ids": ids, "sampling_params": {
            "temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}}).json()
        info = http.get("/server_info").json()
    assert out.choices[0].message.content == ref["text"]
    # language clients read the same template: program roles render with it too
    assert info["chat_template"] is True and info["chat_template_text"] == MARKED
    from plait.runtime_endpoint import _template_from_info

    assert _template_from_info(info).markers("user", ("system",)) == ("[[USER]] ", "\n")


def test_in_process_engine_takes_the_template(base_model):
    """plait.Engine(chat_template=...): its tokenizer carries the given template (it
    carried the model's own, here none)."""
    with Engine(str(base_model), chat_template="chatml", kv_cache_tokens=256) as engine:
        assert "<|im_start|>" in engine.tokenizer.chat_template
        assert engine.server_info()["chat_template"] is True  # the model itself has none
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert text.startswith("<|im_start|>user\nhi")


# -- the given template's end-of-turn text ends chat replies ------------------------------------------
class _Tok:
    def __init__(self, eos: str) -> None:
        self.eos_token, self.bos_token = eos, ""


@pytest.mark.parametrize("source,eos,end", [
    ("chatml", "<|endoftext|>", "<|im_end|>"),  # ChatML on a base model: its EOS is another token
    ("chatml", "<|im_end|>", None),  # the model's EOS ends the turn already
    (MARKED, "<|endoftext|>", None),  # a turn that ends with a newline only
    (None, "<|endoftext|>", None),  # no template given
    ("{{ raise_exception('no chat here') }}", "</s>", None),  # cannot write a turn
])
def test_a_given_templates_turn_end_is_a_stop_string(source, eos, end):
    from plait.chat_template import load_chat_template
    from plait.runtime.server.front import given_turn_end

    text = load_chat_template(source) if source else None
    assert given_turn_end(text, _Tok(eos)) == end


def test_the_turn_end_joins_the_clients_stop_strings():
    """Beside the client's stop (a string or a list), once, within the limit of stop
    strings; not for a forced tool call (its constraint ends the output)."""
    from plait.runtime.sampling_params import MAX_STOP_STRINGS
    from plait.runtime.server.openai_api import ChatRequest

    def sampling(sp, forced=False):
        return ChatRequest([1], {}, None, None, {}, forced, "<|im_end|>").sampling(sp)

    assert sampling({})["stop"] == ["<|im_end|>"]
    assert sampling({"stop": "\n\n"})["stop"] == ["\n\n", "<|im_end|>"]
    assert sampling({"stop": ["a", "<|im_end|>"]})["stop"] == ["a", "<|im_end|>"]
    full = [str(i) for i in range(MAX_STOP_STRINGS)]
    assert sampling({"stop": full})["stop"] == full
    assert "stop" not in sampling({"stop": "x"}, forced=True)
    assert "stop" not in ChatRequest([1], {}, None, None, {}, False).sampling({})
    # nor for a constrained turn: its output may hold the text ({"const": "a<|im_end|>b"})
    for constraint in ({"json_schema": '{"const": "a<|im_end|>b"}'}, {"regex": "x"}):
        assert ChatRequest([1], constraint, None, None, {}, False, "<|im_end|>").sampling({"stop": "z"})["stop"] == "z"
        assert "stop" not in ChatRequest([1], constraint, None, None, {}, False, "<|im_end|>").sampling({})
    # but for the free text around strict tools' calls under auto (its constraint never ends it)
    lazy = ChatRequest([1], {"regex": "x"}, "tools", None, {}, False, "<|im_end|>")
    assert lazy.sampling({"stop": "z"})["stop"] == ["z", "<|im_end|>"]


def test_chatml_given_to_a_base_model_leaves_a_constrained_reply_whole(base_model):
    """The server given ChatML for a base model (whose EOS is <|endoftext|>) adds
    <|im_end|> as a stop string to chat replies (``ChatRequest.sampling``, above) but not
    to a constrained one: forced by a regex to write past <|im_end|>, the reply is what
    the regex asks for (the stop string cut it to "hello", breaking the constraint); a
    completion (no chat template) is not cut either."""
    regex = r"hello<\|im_end\|>\n<\|im_start\|>user"
    with launch(str(base_model), chat_template="chatml", num_threads=1, kv_cache_tokens=1024) as rt, \
            httpx.Client(base_url=rt.url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 40, "temperature": 0,
                                                      "regex": regex}).json()
        assert chat["choices"][0]["message"]["content"] == "hello<|im_end|>\n<|im_start|>user", chat
        assert chat["choices"][0]["finish_reason"] == "stop"
        done = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "temperature": 0,
                                                  "regex": regex}).json()
        assert done["choices"][0]["text"] == "hello<|im_end|>\n<|im_start|>user", done
