"""Records the device side and the API process both read, in a module without torch.

- `SamplingOptions`: one request's validated sampling settings. The frontend's `SamplingParams`
  converts to it, ADD carries it to the engine, the scheduler hands it to the sampler. Field
  order is wire ABI: append new fields at the end.
- `PoolingType`: what a pooling request (embeddings, scores) returns instead of tokens; it
  rides in `SamplingOptions.pooling`, the one per-request record that reaches the scheduler,
  the runner and a resumed request alike.
- `KernelChoice`: the kernels a worker chose at load (`trillm.gpu.runner._kernels.choose_kernels`);
  READY carries it to the frontend for the start-up line, `/version` and the
  `trillm:kernel_info` metric.
- `LoraModule`: a LoRA adapter by name, directory and integer id (vLLM's `LoRARequest`):
  `--lora-modules` parses into it (`parse_lora_module`), the engine's config and the runtime
  load call carry it, the worker reads the directory.

They live outside `trillm.gpu` so that the API process never loads torch to read them.
"""

from __future__ import annotations

import enum
import json

import msgspec


class PoolingType(enum.IntEnum):
    """How a pooling request's prompt hidden states become its result (vLLM's names).

    NONE is generation. LAST: the last token's (a decoder's sentence embedding); MEAN: the
    average over the prompt; CLS: the first token's; ALL: one row per prompt token. Only LAST
    can start from prefix-cache hits: the others read every position's hidden state.
    """

    NONE = 0
    LAST = 1
    MEAN = 2
    CLS = 3
    ALL = 4


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """What the sampler needs to know about one request (already validated)."""

    temperature: float = 1.0  # 0 means greedy (exact argmax)
    top_p: float = 1.0  # 1 means off
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # 0 means off
    presence_penalty: float = 0.0  # on output tokens
    frequency_penalty: float = 0.0  # on output tokens
    repetition_penalty: float = 1.0  # on prompt and output tokens; 1 means off
    seed: int | None = None  # own generator: same tokens whatever else is in the batch
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # (the engine stops on EOS; the sampler only masks it, above)
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob and top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: per prompt position, top k
    # A `PoolingType` other than NONE: a prefill-only request that samples nothing; its
    # pooled hidden states come back in the STEP record's pooled section, and it ends there.
    pooling: int = 0

    @property
    def is_pooling(self) -> bool:
        return self.pooling != PoolingType.NONE

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class KernelChoice(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The kernels in use: device, dtype, the linear path and why. Field order is ABI.

    `linear` is "onednn" (weights packed for oneDNN), "aten" (`F.linear`: MKL on CPU,
    cuBLAS on CUDA); `isa` is what the choice depended on (`CpuFeatures.summary()` on CPU,
    the GPU's name on CUDA); `attention` is the attention backend ("torch" or "triton");
    `quantization` is "gguf" (GGUF blocks kept, int4 kernel) or "none", and
    `quantization_reason` what that means; `decode` is how CPU decode steps run ("c": one C
    call per step, `_cpu_decode`; "c by measurement (...)" / "torch by measurement (...)":
    the sizes each path took when timed, `_decode_probe`; "torch with C's attention
    (--cpu-decode torch...)"; "torch (why)": no C step; "" on CUDA).
    """

    device: str
    dtype: str
    linear: str
    isa: str = ""
    reason: str = ""
    attention: str = ""
    quantization: str = ""
    quantization_reason: str = ""
    decode: str = ""

    def describe(self) -> str:
        """One line for a log: "kernels: bfloat16 on cpu, linears aten (isa ...; reason),
        attention torch, quantization gguf (...)"."""
        why = "; ".join(part for part in (self.isa, self.reason) if part)
        line = f"kernels: {self.dtype} on {self.device}, linears {self.linear} ({why})"
        if self.attention:
            line += f", attention {self.attention}"
            if self.attention == "triton" and self.device == "cpu":
                line += " (Triton's interpreter on CPU: for correctness only, very slow)"
        if self.quantization not in ("", "none"):  # dense weights need no word
            line += f", quantization {self.quantization}"
            if self.quantization_reason:
                line += f" ({self.quantization_reason})"
        if self.decode:
            line += f", decode {self.decode}"
        return line


class LoraModuleError(ValueError):
    """A `--lora-modules` entry is malformed; the message shows the accepted forms."""


class LoraModule(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A LoRA adapter: its name (what requests give as `model`), its PEFT directory, the
    base model it was trained on (shown by /v1/models; None: the served model), and its id.

    `lora_int_id` 0 means "not numbered yet": `numbered` gives the i-th module id i + 1, the
    frontend and the engine alike; adapters loaded at run time get the next free id. Ids,
    never names, cross the request ring (`AddHeader.lora_id`). Field order is ABI.
    """

    name: str
    path: str
    base_model_name: str | None = None
    lora_int_id: int = 0
    # sha256 of the adapter's files once checked ("" before): a restarted engine reads the
    # checked copy of these bytes (or bytes with this digest), never other weights
    digest: str = ""


def parse_lora_module(spec: str) -> LoraModule:
    """One `--lora-modules` entry, in vLLM's forms: `name=path`, or JSON
    `{"name": ..., "path": ..., "base_model_name": ...}`.

    Raises:
        LoraModuleError: neither form, or an empty name or path.
    """
    if spec.lstrip().startswith("{"):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise LoraModuleError(f"--lora-modules {spec!r} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or set(raw) - {"name", "path", "base_model_name"}:
            raise LoraModuleError(
                f"--lora-modules {spec!r}: a JSON entry has the keys name, path and "
                f"(optionally) base_model_name"
            )
        name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
    else:
        name, _, path = spec.partition("=")
        base = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise LoraModuleError(
            f"--lora-modules {spec!r}: give name=path, or JSON "
            f'\'{{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}}\''
        )
    if base is not None and not isinstance(base, str):
        raise LoraModuleError(f"--lora-modules {spec!r}: base_model_name must be a string")
    return LoraModule(name, path, base)


def numbered(modules: tuple[LoraModule, ...] | list[LoraModule]) -> tuple[LoraModule, ...]:
    """`modules` with every id 0 replaced by its position + 1 (the start-up adapters' ids).

    Raises:
        LoraModuleError: two adapters share a name or an id.
    """
    out = tuple(
        m if m.lora_int_id else msgspec.structs.replace(m, lora_int_id=i + 1)
        for i, m in enumerate(modules)
    )
    names = [m.name for m in out]
    ids = [m.lora_int_id for m in out]
    if len(set(names)) != len(names) or len(set(ids)) != len(ids):
        raise LoraModuleError(f"LoRA adapters need distinct names, got {names}")
    return out
