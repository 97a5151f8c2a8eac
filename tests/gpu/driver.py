"""A minimal stand-in for the engine's scheduler, to drive a `ModelRunner` step by step.

It allocates KV blocks in order (no prefix cache, no preemption), admits requests at the
step they arrive, prefills prompts in chunks of at most `chunk` tokens, decodes one token per
step, and stops a request after `max_tokens`. It produces exactly the `StepBatch`es the
runner consumes, so the tests exercise the real device contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trillm.gpu import ModelRunner, NewRequest, RunnerOutput, SamplingOptions, StepBatch

GREEDY = SamplingOptions(temperature=0.0)


@dataclass
class DriverRequest:
    rnum: int
    prompt: list[int]
    max_tokens: int
    options: SamplingOptions = GREEDY
    arrival_step: int = 0
    lora_id: int = 0  # the request's LoRA adapter (0: the base model)
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent_blocks: int = 0
    seen: bool = False
    outputs: list[RunnerOutput] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Driver:
    def __init__(self, runner: ModelRunner, num_blocks: int, *, chunk: int = 1 << 30) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.chunk = chunk
        self.step = 0
        self.history: list[RunnerOutput] = []  # every step's output, in order

    def run(self, requests: list[DriverRequest]) -> list[DriverRequest]:
        finished: list[int] = []
        while not all(r.done for r in requests):
            active = [r for r in requests if r.arrival_step <= self.step and not r.done]
            batch = StepBatch(self.step, finished_rnums=np.array(finished, np.uint64))
            finished = []
            rnums, counts, cached, cached_blocks, cached_computed = [], [], [], [], []
            for r in active:
                total = len(r.prompt) + len(r.output)
                count = min(self.chunk, total - r.computed)
                need = -(-(r.computed + count) // self.block_size)
                while len(r.blocks) < need:
                    r.blocks.append(self.free_blocks.pop())
                if not r.seen:
                    batch.new_requests.append(
                        NewRequest(
                            r.rnum,
                            r.prompt,
                            list(r.blocks),
                            r.computed,
                            r.options,
                            lora_id=r.lora_id,
                        )
                    )
                    r.seen = True
                else:
                    cached.append(r.rnum)
                    cached_blocks.append(r.blocks[r.sent_blocks :])
                    cached_computed.append(r.computed)
                r.sent_blocks = len(r.blocks)
                rnums.append(r.rnum)
                counts.append(count)
                r.computed += count
            batch.cached_rnums = np.array(cached, np.uint64)
            batch.cached_new_block_ids = cached_blocks
            batch.cached_num_computed = np.array(cached_computed, np.int32)
            batch.scheduled_rnums = np.array(rnums, np.uint64)
            batch.num_scheduled_tokens = np.array(counts, np.int32)
            out = self.runner.execute(batch)
            self.history.append(out)
            by_rnum = {r.rnum: r for r in active}
            for rnum, token in zip(out.rnums.tolist(), out.token_ids.tolist(), strict=True):
                request = by_rnum[rnum]
                request.output.append(token)
                request.outputs.append(out)
                if request.done:
                    finished.append(rnum)
                    self.free_blocks.extend(request.blocks)
            self.step += 1
        return requests
