"""Incremental detokenization with stop strings: turns committed token ids into text deltas.

Stop strings are matched on decoded text (a stop can span tokens); the output is cut right
before the first stop string. Text that might still become a stop string, and a trailing
incomplete UTF-8 character (decoded as U+FFFD), is held back until the next tokens decide.

    ts = TextStream(tokenizer.decode, stop=["\\n\\n"])
    delta = ts.push(new_tokens)     # text safe to send now
    if ts.stopped: ...              # a stop string was hit: cancel the generation
    tail = ts.finish()              # at the end: whatever was held back
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None) -> None:
        self._decode = decode
        self.stop = [s for s in (stop or []) if s]
        self.tokens: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False
        self.stop_tokens: int | None = None  # tokens up to and including the one completing the stop

    def _first_stop(self, full: str, search_from: int) -> int | None:
        hits = [i for s in self.stop if (i := full.find(s, max(0, search_from))) >= 0]
        return min(hits) if hits else None

    def _held_back(self, full: str) -> int:
        """Length of the longest tail of `full` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), best, -1):
                if full.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, new_tokens: list[int]) -> str:
        """Add committed tokens; return the text that can be sent now ('' when held back or stopped)."""
        if self.stopped or not new_tokens:
            return ""
        before = len(self.tokens)
        self.tokens.extend(int(t) for t in new_tokens)
        full = self._decode(self.tokens)
        # a stop can only start after the text already sent: a possible stop prefix is never sent
        hit = self._first_stop(full, len(self.text))
        if hit is not None:
            self.stopped = True
            self.stop_tokens = self._tokens_to_cover(hit, before)
            return self._emit(full[:hit])
        stable = full.rstrip("\ufffd")  # an incomplete multi-byte character decodes to U+FFFD
        return self._emit(stable[: len(stable) - self._held_back(stable)])

    def finish(self) -> str:
        """The held-back tail once generation has ended without a stop string."""
        if self.stopped:
            return ""
        return self._emit(self._decode(self.tokens))

    def _emit(self, upto: str) -> str:
        # decoding is append-only for byte-level BPE; if a tokenizer rewrote earlier text
        # (space clean-up), the sent prefix stands and only the new tail is sent
        if not upto.startswith(self.text):
            delta = upto[len(self.text) :] if len(upto) > len(self.text) else ""
        else:
            delta = upto[len(self.text) :]
        self.text += delta
        return delta

    def _tokens_to_cover(self, hit: int, before: int) -> int:
        """Fewest tokens whose text contains the stop string found at `hit` (for usage counts)."""
        for n in range(max(before, 1), len(self.tokens) + 1):
            if self._first_stop(self._decode(self.tokens[:n]), hit) == hit:
                return n
        return len(self.tokens)
