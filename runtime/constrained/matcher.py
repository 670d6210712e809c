"""One request's grammar state: allowed tokens, advance, final, healing, jump-forward.

Life of a matcher: created with the request (its index may still be compiling);
``start(prompt_ids)`` once the index is ready, which may back off the last prompt
token (healing), then ``jump_start`` (forced opening text); then for every token the
scheduler appends, ``advance``, after which ``jump_forward`` may propose the forced
text as tokens to put in place of that token.

Healing: with the prompt ``Answer: `` (ending in a lone space token) and the constraint
``(yes|no)``, the model would have to write ``yes`` after a lone space, a tokenization
it never saw in training: its own continuation of ``Answer:`` is the token ``" yes"``.
So when some token can cross the boundary, the last prompt token is removed and its
bytes become the first thing the output must write; the model may then pick
``" yes"``. The healed text is not part of the returned text (``Req.text_skip``).
"""

from __future__ import annotations

import numpy as np

from plait.runtime.constrained.compiler import CompiledGrammar, GrammarFuture
from plait.runtime.constrained.jump_forward import CharTracker


class GrammarMatcher:
    """Per-request state over a shared ``CompiledGrammar``: the index state, the heal
    bytes still to write, and the character tracker jump-forward reads."""

    def __init__(self, future: GrammarFuture, kind: str = "regex", *, jump_forward: bool = True,
                 heal: bool = True) -> None:
        self.future = future
        self.kind = kind  # the request field the constraint came from (what a failure names)
        self.use_jump_forward = jump_forward
        self.use_heal = heal
        self.g: CompiledGrammar | None = None
        self.state = 0
        self.heal = b""  # bytes the output must still write before the constraint starts
        self.healed_text = ""  # the backed-off prompt token's text
        self.chars: CharTracker | None = None
        self.started = False
        self.rejected: int | None = None  # a token the grammar did not allow (a bug if set)
        self.num_advanced = 0
        # state before the newest token, for re-tokenizing it at a jump
        self._prev_state = 0
        self._prev_heal = b""
        self._prev_chars: tuple[int | None, bytes] | None = None

    # -- readiness ------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.future.grammar is not None

    @property
    def error(self) -> str | None:
        return self.future.error

    def start(self, prompt_ids: list[int]) -> int:
        """Begin at the initial state; returns how many prompt tokens to drop (0 or 1)
        because the boundary is healed."""
        g = self.future.grammar
        assert g is not None, "start() before the index is ready"
        self.g = g
        self.state = g.initial
        self.started = True
        if g.chars is not None and self.use_jump_forward:
            self.chars = CharTracker(g.chars)
        if not self.use_heal or len(prompt_ids) < 2:
            return 0
        last = g.vocab.token_bytes[prompt_ids[-1]] if 0 <= prompt_ids[-1] < len(g.vocab.token_bytes) else None
        if not last:
            return 0
        try:
            text = last.decode("utf-8")
        except UnicodeDecodeError:
            return 0
        table = g.heal_table(last)
        if not any(st is not None and len(g.vocab.token_bytes[t]) > len(last) for t, (st, _) in table.items()):
            return 0  # no token crosses the boundary: nothing to heal
        self.heal = last
        self.healed_text = text
        return 1

    def jump_start(self, budget: int) -> list[int]:
        """After ``start``: the text the constraint forces before anything else (``{"name":"``
        of a JSON object), as the tokenizer writes it, to put into the output before the
        first model step (it is prefilled with the prompt). At most ``budget`` tokens; the
        last one is held back when a longer token could continue from it. Not while the
        boundary is healed (the model writes across it)."""
        g = self.g
        if self.chars is None or self.heal or g.vocab.encode is None or budget < 1:
            return []
        forced = self.chars.forced()
        if not forced:
            return []
        data = forced.encode("utf-8")
        tokens = g.vocab.encode(forced)
        states = g.walk(self.state, tokens) if g.vocab.join(tokens) == data else None
        if not states:
            return []
        keep = len(tokens)
        before_last = states[-2] if keep > 1 else self.state
        if g.has_continuation(states[-1]) and g.can_extend(before_last, tokens[-1]):
            keep -= 1
        keep = min(keep, budget)
        if keep == 0:
            return []
        self.state = states[keep - 1]
        self.chars.feed(g.vocab.join(tokens[:keep]))
        self.num_advanced += keep
        return tokens[:keep]

    # -- masks ----------------------------------------------------------------------------
    @property
    def is_final(self) -> bool:
        return self.started and not self.heal and self.g.is_final(self.state)

    @property
    def terminated(self) -> bool:
        """Final with nothing more to write: the output is complete."""
        return self.is_final and not self.g.has_continuation(self.state)

    def allowed(self, eos_ok: bool) -> np.ndarray:
        """Packed allowed-token bits (``int32 [words]``) for the next token; EOS ids are
        allowed in final states when ``eos_ok``."""
        g = self.g
        if self.heal:  # never final while healing: no EOS
            return g.pack(list(g.heal_table(self.heal)))
        return self._state_mask(self.state, eos_ok)

    def _state_mask(self, state: int, eos_ok: bool) -> np.ndarray:
        g = self.g
        m = g.mask(state)
        if eos_ok and g.is_final(state) and g.vocab.eos_ids:
            u = m.view(np.uint32).copy()
            for e in g.vocab.eos_ids:
                if e < g.words * 32:
                    u[e >> 5] |= np.uint32(1 << (e & 31))
            m = u.view(np.int32)
        return m

    def draft_masks(self, drafts: list[int], eos_ok: bool) -> list[np.ndarray]:
        """Speculative decoding: the :meth:`allowed` rows for the next token and after
        each of ``drafts`` in turn, up to the first draft the grammar refuses (``1 +``
        the number of drafts it takes). The matcher does not move (the walk is over
        index states). None are taken while the boundary is healed."""
        masks = [self.allowed(eos_ok)]
        if self.heal:
            return masks
        state: int | None = self.state
        for t in drafts:
            state = self.g.next_state(state, t)
            if state is None:
                break
            masks.append(self._state_mask(state, eos_ok))
        return masks

    # -- advancing ------------------------------------------------------------------------
    def advance(self, token: int) -> bool:
        """Take ``token``; False if the grammar does not allow it (state unchanged)."""
        g = self.g
        self._prev_state, self._prev_heal = self.state, self.heal
        self._prev_chars = self.chars.snapshot() if self.chars is not None else None
        if self.heal:
            entry = g.heal_table(self.heal).get(token)
            if entry is None:
                self.rejected = token
                return False
            st, rest = entry
            if st is not None:
                self.state = st
                tb = g.vocab.token_bytes[token]
                if self.chars is not None:
                    self.chars.feed(tb[len(self.heal) :])
            self.heal = rest
        else:
            st = g.next_state(self.state, token)
            if st is None:
                self.rejected = token
                return False
            self.state = st
            if self.chars is not None:
                self.chars.feed(g.vocab.token_bytes[token])
        self.num_advanced += 1
        return True

    def jump_forward(self, last: int, budget: int) -> list[int] | None:
        """After ``advance(last)``: tokens to put in place of ``last`` that write its
        bytes plus the forced text, tokenized as the tokenizer would (re-tokenized at the
        boundary); at most ``budget`` tokens. None when there is nothing to gain.

        The last re-tokenized token is held back when a longer token starting with it
        could continue the output: the model then writes across that boundary itself.
        """
        g = self.g
        if self.chars is None or self._prev_heal or self.heal or g.vocab.encode is None or budget < 1:
            return None
        forced = self.chars.forced()
        if not forced:
            return None
        head = g.vocab.token_bytes[last]
        data = head + forced.encode("utf-8")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        tokens = g.vocab.encode(text)
        if g.vocab.join(tokens) != data:
            return None  # the tokenizer would not write these bytes back (prefix spaces, specials)
        states = g.walk(self._prev_state, tokens)
        if states is None:
            return None
        keep = len(tokens)
        if g.has_continuation(states[-1]) and keep > 1 and g.can_extend(states[-2], tokens[-1]):
            keep -= 1
        keep = min(keep, budget)
        if len(g.vocab.join(tokens[:keep])) <= len(head):
            return None
        tokens, self.state = tokens[:keep], states[keep - 1]
        if self.chars is not None:
            self.chars.restore(self._prev_chars)
            self.chars.feed(g.vocab.join(tokens))
        self.num_advanced += keep - 1
        return tokens

