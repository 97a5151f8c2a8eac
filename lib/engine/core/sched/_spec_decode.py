"""The scheduler's side of speculative decoding: which drafts a step verifies, and counters.

The runner proposes up to k drafts per sampling row after each step (`RunnerOutput.
draft_offsets`); the request keeps them (`Request.spec_token_ids`) and its next decode
schedules 1 + len(drafts) tokens. Drafts are cut so that a step can never carry a request
past `max_model_len` or `max_tokens` (a step emits at most drafts + 1 tokens), nor past the
token budget, and, under a grammar, at the first draft the grammar refuses (llguidance's
`validate_tokens`): such a draft is rejected before it costs a forward.

After the step, the runner says how many drafts each row accepted (its tokens are the
accepted drafts and one more); the scheduler rolls `num_computed_tokens` back over the
rejected ones (their K/V slots stay the request's and are written again), so only accepted
tokens reach the prefix cache, which indexes full blocks of computed tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._request import Request


def usable_drafts(request: Request, budget: int, max_model_len: int) -> list[int]:
    """The prefix of `request.spec_token_ids` its next step verifies, within `budget` more
    tokens (beyond its one), `max_model_len`, `max_tokens` and its grammar."""
    drafts = request.spec_token_ids
    room = min(
        budget,
        max_model_len - request.num_tokens - 1,
        request.max_tokens - request.num_output_tokens - 1,
    )
    if room <= 0:
        return []
    drafts = drafts[:room]
    if request.grammar is not None and drafts:
        drafts = drafts[: request.grammar.matcher.validate_tokens(drafts)]
    return drafts


@dataclass
class SpecDecodingStats:
    """Cumulative counts, as vLLM's `vllm:spec_decode_*` metrics: rows that verified drafts,
    drafts verified, drafts accepted, and accepted by position (0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One row verified `num_draft_tokens` drafts and accepted the first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per = self.accepted_per_position
        if len(per) < num_draft_tokens:
            per.extend([0] * (num_draft_tokens - len(per)))
        for j in range(num_accepted):
            per[j] += 1
