"""A mixture-of-experts block: a softmax top-k router, then the experts run grouped.

Why grouped: a step's token-to-expert pairs are sorted by expert once, and each active expert
runs one product over its tokens (gate/up, activation, down), weighted by the router and
scattered back with `index_add_`. Experts no token chose are never read, so a decode step of
one token reads k experts' weights of E; there is no Python loop over tokens.

Tensor parallel splits each expert's intermediate dimension across ranks (vLLM's fused MoE
does the same): every rank holds a slice of every expert, runs the same routing (the router
is replicated), and one all-reduce sums the partial outputs. GGUF experts kept quantized
(`--quantization gguf`) stay in their blocks, one packed weight per expert and projection.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..cpu._cpu_ops import gated
from ..quant._gguf_blocks import QuantizedTensor
from ..quant._quantized import QuantizedLinearWeight, pack_quantized
from ._parallel import TensorParallel

_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


class FusedMoE(nn.Module):
    """Router `gate` [E, hidden] and experts stacked: `w13` [E, 2 I_shard, hidden] (gate rows,
    then up rows), `w2` [E, hidden, I_shard]."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool,
        act: str,
        tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} is not in 1..{num_experts}")
        self.tp, self.act = tp, act
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.shard = tp.split(intermediate, "moe_intermediate_size")
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(
            torch.zeros(num_experts, 2 * self.shard, hidden, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.zeros(num_experts, hidden, self.shard, dtype=dtype), requires_grad=False
        )
        self._parts: dict[tuple[int, str], QuantizedTensor] = {}
        self.quantized: list[tuple[QuantizedLinearWeight, QuantizedLinearWeight]] | None = None
        self.quantized_bytes = 0

    def load_checkpoint(
        self, path: str, tensor: torch.Tensor | QuantizedTensor, *, is_bias: bool
    ) -> bool:
        """Load `gate` (the router) or `experts.E.{gate,up,down}_proj`; False for any other
        name (the caller then reports it)."""
        if is_bias:
            return False
        if path == "gate":
            self.gate.weight.data.copy_(_dense(tensor))
            return True
        match = _EXPERT.match(path)
        if match is None or int(match.group(1)) >= self.num_experts:
            return False
        expert, proj = int(match.group(1)), match.group(2)
        start = self.tp.rank * self.shard
        if isinstance(tensor, QuantizedTensor):
            part = (
                tensor.cols(start, self.shard)
                if proj == "down_proj"
                else tensor.rows(start, self.shard)
            )
            self._parts[expert, proj] = part
        elif proj == "down_proj":
            self.w2.data[expert].copy_(tensor.narrow(1, start, self.shard))
        else:
            row = 0 if proj == "gate_proj" else self.shard
            self.w13.data[expert, row : row + self.shard].copy_(tensor.narrow(0, start, self.shard))
        return True

    def finish_quantized(self) -> None:
        """Pack every expert's kept blocks (all experts came quantized, or none are kept)."""
        parts, self._parts = self._parts, {}
        names = ("gate_proj", "up_proj", "down_proj")
        if len(parts) != 3 * self.num_experts:
            for (expert, proj), blocks in parts.items():  # a file that mixes types
                dense = blocks.dequantize()
                if proj == "down_proj":
                    self.w2.data[expert].copy_(dense)
                else:
                    row = 0 if proj == "gate_proj" else self.shard
                    self.w13.data[expert, row : row + self.shard].copy_(dense)
            return
        self.quantized = [
            (
                pack_quantized([parts[e, names[0]], parts[e, names[1]]]),
                pack_quantized([parts[e, names[2]]]),
            )
            for e in range(self.num_experts)
        ]
        self.quantized_bytes = sum(
            parts[e, n].nbytes for e in range(self.num_experts) for n in names
        )
        self.w13.data = torch.empty(0, dtype=self.w13.dtype)
        self.w2.data = torch.empty(0, dtype=self.w2.dtype)

    def unread_bytes_per_token(self) -> int:
        """Weight bytes of the experts one token is not routed to (for `decode_read_bytes`)."""
        total = self.quantized_bytes or (
            self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()
        )
        return total * (self.num_experts - self.top_k) // self.num_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (x's dtype): softmax
        over the router's logits in float32, renormalised over the k when asked."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        # Each token's k pairs ascending by expert: the order transformers adds them in.
        experts, by_expert = experts.sort(dim=1)
        weights = weights.gather(1, by_expert)
        # The grouping is host work on a few thousand ints at most: numpy's, without torch's
        # per-op dispatch (on CUDA this is the layer's one sync).
        flat = experts.flatten().cpu().numpy()
        order = np.argsort(flat, kind="stable")  # pairs grouped by expert, tokens in order
        counts = np.bincount(flat, minlength=self.num_experts)
        pairs = torch.from_numpy(order).to(x.device)
        tokens = pairs // self.top_k
        pair_weights = weights.flatten()[pairs].unsqueeze(1)
        # Each pair's weighted output lands in its own row (a copy, where `index_add_` into
        # the tokens' rows took 3 ms a call on the CPU), then each token sums its k rows.
        ys = torch.empty(len(flat), x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for expert in np.flatnonzero(counts).tolist():
            end = start + int(counts[expert])
            rows = tokens[start:end]
            y = self._expert(expert, x if len(flat) == self.top_k else x.index_select(0, rows))
            ys.index_copy_(0, pairs[start:end], y * pair_weights[start:end])
            start = end
        per_token = ys.view(-1, self.top_k, x.shape[1])
        out = per_token[:, 0].clone()
        for j in range(1, self.top_k):
            out += per_token[:, j]
        return self.tp.all_reduce(out)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            gate_up, down = self.quantized[expert]
            return down(gated(gate_up(x), self.act).to(x.dtype)).to(x.dtype)
        return F.linear(gated(F.linear(x, self.w13[expert]), self.act), self.w2[expert])


def _dense(tensor: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
