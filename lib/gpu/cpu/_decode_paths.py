"""Which path a CPU decode step takes, by its size: a table of timings (`DecodePaths`).

A decode step (one token per sequence) of n sequences runs either the C step (`CpuStep.run`)
or the torch forward with C's attention (`CpuStep.attention`). Which is faster depends on the
machine, the model and n: on the 2-core AVX-512 machine the C step won at every size up to
64 (8.24 against 15.75 ms at 1, 63.4 against 73.1 at 64, SmolLM2 float32), on an AVX2-only
CPU it loses to oneDNN's linears (docs/design.md, "Known, not fixed"), and in bfloat16 on an
AMX CPU whose C tiles cannot use the tile unit oneDNN wins from about 20 decodes. So the
choice is measured (`_decode_probe`) into this table rather than derived from the ISA.

The rule: a step of n decodes takes the winner at the smallest measured size >= n; above the
largest measured size, the largest's winner; never the C step above its `max_batch` (the
caller's bound, `CpuStep.covers`). A path that loses at every measured size is never taken.
`--cpu-decode c` / `torch` force the answer (`forced`).
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.95  # the C tiles take prompts' linears at most this share of torch's time


@dataclass(frozen=True)
class DecodeTiming:
    """One measured step size: the ms of a decode step of `batch` sequences by the C step and
    by the torch forward with C's attention (the fastest of a few runs)."""

    batch: int
    c_ms: float
    torch_ms: float

    @property
    def c_wins(self) -> bool:
        """The C step at a tie: it was the only path before there was a measurement."""
        return self.c_ms <= self.torch_ms


@dataclass(frozen=True)
class PromptTiming:
    """One layer's four linears at `tokens` tokens: ms on the C tiles and as the torch
    forward runs them (oneDNN's packed copies, or F.linear where oneDNN cannot pack)."""

    tokens: int
    tiles_ms: float
    torch_ms: float

    @property
    def tiles_win(self) -> bool:
        return self.tiles_ms <= MARGIN * self.torch_ms

    def describe(self) -> str:
        """For `KernelChoice.decode`: "prompts' linears on the C tiles (512 tokens, a layer:
        tiles 20.1 / torch 24.9 ms)"."""
        where = "on the C tiles" if self.tiles_win else "in torch"
        return (
            f"prompts' linears {where} ({self.tokens} tokens, a layer: tiles "
            f"{self.tiles_ms:.1f} / torch {self.torch_ms:.1f} ms)"
        )


@dataclass(frozen=True)
class DecodePaths:
    """The decode path by step size: measured `timings` (ascending sizes), or `forced`.

    `forced`: "c" (every size up to the C step's `max_batch`), "torch" (none), "" (measured);
    `cached`: read from the cache, not measured in this process; `note`: what limited the
    measurement (its time budget), shown with the table; `prompt`: where the torch forward's
    dense linears multiply (`_prompt_linears`; None: not measured, oneDNN).
    """

    timings: tuple[DecodeTiming, ...] = ()
    forced: str = ""
    cached: bool = False
    note: str = ""
    prompt: PromptTiming | None = None

    def takes_c_step(self, num_decodes: int) -> bool:
        """Whether a decode step of `num_decodes` sequences (within the C step's bound)
        runs the C step."""
        if self.forced or not self.timings:
            return self.forced != "torch"
        for timing in self.timings:
            if num_decodes <= timing.batch:
                return timing.c_wins
        return self.timings[-1].c_wins

    def describe(self, max_batch: int) -> str:
        """The opening of `KernelChoice.decode` (the caller closes the parenthesis): "c (one
        call per step of up to 64 decodes", "torch with C's attention (--cpu-decode torch",
        or "c by measurement (ms, c / torch: 1 8.2/15.1, ...; c up to 16 decodes, torch
        above; cached"."""
        if self.forced == "torch":
            return "torch with C's attention (--cpu-decode torch"
        if self.forced or not self.timings:
            why = f"; {self.note}" if self.note else ""
            return f"c (one call per step of up to {max_batch} decodes{why}"
        table = ", ".join(f"{t.batch} {t.c_ms:.1f}/{t.torch_ms:.1f}" for t in self.timings)
        winner = "c" if any(t.c_wins for t in self.timings) else "torch"
        parts = [f"ms, c / torch: {table}", self.routing(max_batch)]
        parts += [self.note] if self.note else []
        parts += [self.prompt.describe()] if self.prompt else []
        parts += ["cached"] if self.cached else []
        return f"{winner} by measurement ({'; '.join(parts)}"

    def routing(self, max_batch: int) -> str:
        """Which sizes take which path, in words: "c up to 16 decodes, torch above"."""
        spans: list[tuple[bool, int, int]] = []  # (C wins, first size, last size)
        first = 1
        for i, t in enumerate(self.timings):
            last = max_batch if i == len(self.timings) - 1 else t.batch
            if spans and spans[-1][0] == t.c_wins:
                spans[-1] = (t.c_wins, spans[-1][1], last)
            else:
                spans.append((t.c_wins, first, last))
            first = last + 1
        if len(spans) == 1:
            return f"c up to {max_batch} decodes" if spans[0][0] else "torch at every size"
        if len(spans) == 2 and spans[0][0]:
            return f"c up to {spans[0][2]} decodes, torch above"
        sizes = {
            wins: ", ".join(f"{a}-{b}" if a < b else f"{a}" for c, a, b in spans if c == wins)
            for wins in (True, False)
        }
        return f"c for {sizes[True]} decodes, torch for {sizes[False]}"


C_STEP = DecodePaths(forced="c")  # `--cpu-decode c`, and before a measurement
TORCH = DecodePaths(forced="torch")  # `--cpu-decode torch`
