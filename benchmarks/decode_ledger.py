"""Decode work done twice, which `bench qos` and `bench scale` report as
`preempted_tokens_wasted`.

Per request: the tokens the engine generated over all of its runs, less the tokens of the
output it finished with. A run that resumes after an earlier run's tokens (the engine's
`resume`) adds only what it generates itself, so the figure is 0 when every run stopped
unfinished (preempted, handed back) had its work kept; a request that never finished is
left out (its work may yet be resumed).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tierq.workers.engine.base import Chunk


@dataclass
class DecodeLedger:
    generated: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    final: dict[str, int] = field(default_factory=dict)
    resumed: int = 0  # tokens runs resumed after (kept from a stopped run, not generated)

    def generate(self, request_id: str, tokens: int) -> None:
        """The engine generated `tokens` new tokens for the request."""
        self.generated[request_id] += tokens

    def finish(self, request_id: str, output_tokens: int) -> None:
        """A run of the request finished with `output_tokens` in its output (those it
        resumed after included)."""
        self.final[request_id] = output_tokens

    def wasted(self) -> int:
        return sum(self.generated[r] - n for r, n in self.final.items())

    async def counted(
        self, request_id: str, resume: Sequence[int], chunks: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        """The chunks of one run of the request (continuing after `resume`), counted."""
        output = len(resume)
        self.resumed += len(resume)
        async for chunk in chunks:
            self.generate(request_id, chunk.new_tokens)
            output += chunk.new_tokens
            if chunk.finish_reason not in (None, "abort"):  # vLLM ends an aborted run so
                self.finish(request_id, output)
            yield chunk
