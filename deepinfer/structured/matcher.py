"""Per-request grammar state: trigger detection, the xgrammar matcher, rollback.

Invariant: ``num_seen`` output tokens have been consumed (``_tokens``), and for each of them
``_accepted`` records whether the matcher took it (False for tokens before the
trigger completed, and for the trigger tokens themselves). Rolling back ``n``
tokens therefore rolls the matcher back by exactly the number it accepted among
them, and switches the grammar off again if the trigger is rolled back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GrammarViolation", "RequestGrammar", "new_matcher"]


class GrammarViolation(RuntimeError):
    """A sampled token the grammar rejects: the mask was not applied (an engine bug)."""


def new_matcher(compiled: Any) -> Any:
    """A fresh matcher of either backend: ``xgrammar.GrammarMatcher`` for an xgrammar
    ``CompiledGrammar``, ``llg_backend.LLGMatcher`` for an ``LLGCompiled`` (same methods)."""
    if hasattr(compiled, "new_matcher"):
        return compiled.new_matcher()
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


class RequestGrammar:
    """Drives one request's grammar matcher (either backend) from its output tokens."""

    def __init__(self, compiled: xgrammar.CompiledGrammar | Any, trigger: tuple[int, ...] | None = None) -> None:
        self.compiled = compiled
        self.trigger = tuple(trigger) if trigger else None
        self.matcher: Any = None if self.trigger else new_matcher(compiled)
        self.trigger_end: int | None = None if self.trigger else 0  # output index where the grammar starts
        self.num_seen = 0
        self._accepted: list[bool] = []
        self._tokens: list[int] = []  # every consumed token (restores the trigger tail on rollback)
        self._tail: list[int] = []  # the last len(trigger) tokens while waiting for it

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """The grammar constrains the next token (trigger seen, not terminated)."""
        return self.matcher is not None and not self.matcher.is_terminated()

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and accepted EOS: the output must end here."""
        return self.matcher is not None and self.matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS would be accepted)."""
        return self.matcher is not None and self.matcher.is_completed()

    # -------------------------------------------------------------- advancing
    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Consume ``output_token_ids[num_seen:]`` (real sampled tokens only)."""
        for token in output_token_ids[self.num_seen:]:
            self.accept(int(token))

    def accept(self, token: int) -> None:
        """Feed one output token; raises GrammarViolation if the grammar rejects it."""
        if self.matcher is None:
            self._accepted.append(False)
            self._tokens.append(token)
            self.num_seen += 1
            self._tail = (self._tail + [token])[-len(self.trigger):]  # type: ignore[arg-type]
            if tuple(self._tail) == self.trigger:  # grammar applies from the next token on
                self.matcher = new_matcher(self.compiled)
                self.trigger_end = self.num_seen
            return
        if not self.matcher.accept_token(token):
            raise GrammarViolation(
                f"token {token} at output index {self.num_seen} is rejected by the grammar: the token "
                f"bitmask was not applied to this request's logits (engine bug)")
        self._accepted.append(True)
        self._tokens.append(token)
        self.num_seen += 1

    def try_accept(self, token: int) -> bool:
        """Feed one speculative token if the grammar allows it; False (state unchanged) if not.

        Before the trigger every token is allowed; after the grammar terminated (EOS
        accepted) none is."""
        if self.matcher is None:
            self.accept(token)
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self._accepted.append(True)
        self._tokens.append(token)
        self.num_seen += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` consumed tokens (rejected speculative drafts); a
        rollback across the trigger switches the grammar off again."""
        if not 0 <= num_tokens <= self.num_seen:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self.num_seen} were consumed")
        if num_tokens == 0:
            return
        dropped = self._accepted[-num_tokens:]
        del self._accepted[-num_tokens:]
        del self._tokens[-num_tokens:]
        self.num_seen -= num_tokens
        if self.trigger_end is not None and self.trigger is not None and self.num_seen < self.trigger_end:
            self.matcher, self.trigger_end = None, None  # the trigger itself was rolled back
            self._tail = self._tokens[-len(self.trigger):]
        elif self.matcher is not None and sum(dropped):
            self.matcher.rollback(sum(dropped))

    def fill(self, bitmask: object, row: int) -> None:
        """Write the allowed-token bits for the next token into ``bitmask[row]``."""
        assert self.matcher is not None
        self.matcher.fill_next_token_bitmask(bitmask, row)

    # ------------------------------------------------------- speculative drafts
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts after the tokens consumed so far
        (the state is restored)."""
        n = 0
        for t in tokens:
            if not self.try_accept(int(t)):
                break
            n += 1
        self.rollback(n)
        return n

    def fill_draft_rows(self, bitmask: object, first_row: int, drafts: Sequence[int]) -> None:
        """Masks of the ``len(drafts) + 1`` verify rows of one request: row ``j`` allows
        what the grammar allows after the consumed tokens plus ``drafts[:j]`` (all ones where the
        grammar is not active yet, or after a draft it rejects or after its end: such
        rows are never sampled from). The state is restored."""
        n, broken = 0, False
        for j in range(len(drafts) + 1):
            if j:
                broken = broken or not self.try_accept(int(drafts[j - 1]))
                n += not broken
            if broken or not self.active:
                bitmask[first_row + j].fill_(-1)  # type: ignore[index]
            else:
                self.fill(bitmask, first_row + j)
        self.rollback(n)
