"""Deeply nested grammars must not kill the process. An ``ebnf`` grammar of 3000 Lark
rules each calling the next (67 KB, under the 100 000-character limit), or 1000 rules
with 20 parentheses each, overflowed the default 8 MB thread stack inside llguidance's
grammar check (the front's validation) and again in the engine's build, and the
process died with a segmentation fault: one request took the server down. Both now
run on threads with a 256 MB stack (``DEEP_STACK_BYTES``). Each case runs in a child
process, so a regression fails the test instead of ending the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def chain(n: int, parens: int = 0) -> str:
    rules = ["start: r0"]
    rules += [f"r{i}: " + "(" * parens + f'"a" r{i + 1}' + ")" * parens + ' | "b"' for i in range(n)]
    rules.append(f'r{n}: "c"')
    return "\n".join(rules)


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)


def test_the_check_of_a_deep_grammar_does_not_crash():
    for grammar in (chain(3000), chain(1000, parens=20), chain(4400)):
        assert len(grammar) <= 100_000
        r = run_child(f"""
            from plait.runtime.sampling_params import SamplingParams
            c = SamplingParams.from_dict({{"ebnf": {grammar!r}}}).constraint()
            print("checked", c.backend)
        """)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        assert "checked llguidance" in r.stdout


def test_an_engine_builds_and_follows_a_deep_grammar(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    r = run_child(f"""
        from plait.runtime.engine import Engine
        with Engine({path!r}, kv_cache_tokens=2048) as e:
            out = e.generate("x", {{"ebnf": {chain(3000)!r}, "temperature": 1.0, "seed": 3,
                                    "max_new_tokens": 40}})
            print("TEXT", repr(out["text"]))
            # the engine serves the next request as before
            print("NEXT", e.generate("y", {{"regex": "[ab]{{3}}", "max_new_tokens": 5}})["text"])
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    text = eval(r.stdout.split("TEXT ", 1)[1].splitlines()[0])
    # the language: a* then b (any depth) or a^3000 c; 40 tokens end early or cut the a's
    body = text.rstrip("bc")
    assert set(body) <= {"a"} and text[len(body):] in ("", "b", "c")
    nxt = r.stdout.split("NEXT ", 1)[1].splitlines()[0]
    assert len(nxt) == 3 and set(nxt) <= {"a", "b"}
