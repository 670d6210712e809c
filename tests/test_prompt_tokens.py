"""Text prompts are encoded as Hugging Face's default encoding does (a BOS in front when
the tokenizer puts one there), never with a second BOS, and rendered chats as written."""

from __future__ import annotations

from plait.runtime.prompt_tokens import encode_prompt, leading_bos


class CharTokenizer:
    """ids: BOS 1, then one id per character (ord + 10); "<s>" is the BOS text."""

    bos_token_id = 1

    def __init__(self, adds_bos: bool) -> None:
        self.adds_bos = adds_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("<s>", i):
                ids.append(1)
                i += 3
            else:
                ids.append(ord(text[i]) + 10)
                i += 1
        return ([1] if add_special_tokens and self.adds_bos else []) + ids


def test_bos_is_put_first_when_the_tokenizer_adds_one():
    tok = CharTokenizer(adds_bos=True)
    assert leading_bos(tok) == 1
    assert encode_prompt(tok, "ab") == tok.encode("ab") == [1, 107, 108]
    assert encode_prompt(tok, "<s>ab") == [1, 107, 108]  # a template that wrote it: not twice
    assert encode_prompt(tok, "ab", bos=False) == [107, 108]  # a rendered chat, as written
    assert encode_prompt(tok, "") == []


def test_no_bos_when_the_tokenizer_adds_none(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = CharTokenizer(adds_bos=False)
    assert leading_bos(tok) is None and encode_prompt(tok, "ab") == [107, 108]
    real = AutoTokenizer.from_pretrained(tokenizer_dir)  # SmolLM2's: no BOS by default
    text = "The capital of France is"
    assert encode_prompt(real, text) == real.encode(text) == real.encode(text, add_special_tokens=False)
