"""SGLang's ``sglang.test`` module paths that scripts import next to the language
(``from sglang.test.test_utils import select_sglang_backend`` becomes ``from
plait.test.test_utils import select_sglang_backend``)."""
