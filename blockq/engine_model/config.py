"""The configuration of one engine instance, as vLLM's engine arguments describe it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

# How the GPUs of one tensor-parallel instance talk: "none" for one GPU.
INTERCONNECTS = ("none", "pcie", "nvlink")
MAX_GPU_NAME_CHARS = 32
MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and scheduling limits of one engine instance (immutable, validated).

    Fields mirror vLLM's engine arguments:

    * ``num_gpu_blocks``: KV-cache blocks on the GPU.
    * ``block_size``: tokens per KV block.
    * ``max_num_seqs``: most requests running at once (continuous batching).
    * ``max_num_batched_tokens``: per-step token budget (chunked prefill); at least
      ``max_num_seqs``, as vLLM requires, so every running decode fits in one step.
    * ``max_model_len``: most tokens (prompt + output) of one request; its blocks must fit
      in the cache beside the watermark, so that a request alone can always run to the end.
    * ``watermark``: fraction of blocks kept free when admitting a request beside running
      ones (vLLM's default is 0.0).
    * ``enable_prefix_caching``: reuse cached KV blocks of identical leading prompt blocks.
    * ``long_prefill_token_threshold``: most tokens one request is scheduled in a step
      while other requests are running or waiting (vLLM's; 0 = no cap); at most
      ``max_model_len``.
    * ``max_loras``: most distinct LoRA adapters in one step's batch, and adapters resident
      on the GPU at once (vLLM's ``max_loras``; 0 = LoRA off). A waiting request whose
      adapter would be one too many is skipped for the step, as vLLM does.
    * ``lora_load_ms``: what loading an adapter that is not resident adds to the step that
      first needs it (the engine model's charge; docs/dispatcher.md, "Models and adapters").

    The instance's hardware, published with every beat so that a policy can tell GPUs
    apart (``dispatcher.policies.hardware``); the scheduler does not read them:

    * ``gpu``: the GPU type (``a30``, ``a100``, ``h100``; "" when unknown).
    * ``tensor_parallel_size``: GPUs the model is sharded over (vLLM's
      ``--tensor-parallel-size``); ``num_gpu_blocks`` counts the blocks of all of them.
    * ``interconnect``: how they exchange activations (:data:`INTERCONNECTS`; ``none``
      for one GPU).

    Raises:
        ValueError: naming the field and its limit, when a value is out of range.
    """

    num_gpu_blocks: int = 1052
    block_size: int = 16
    max_num_seqs: int = 48
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    long_prefill_token_threshold: int = 0
    max_loras: int = 0
    lora_load_ms: float = 0.0
    gpu: str = ""
    tensor_parallel_size: int = 1
    interconnect: str = "none"

    def __post_init__(self) -> None:
        self._check_hardware()
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an int (got {type(value).__name__})")
            if value < 1:
                raise ValueError(f"{name}: must be >= 1 (got {value})")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2 (got {self.max_model_len})")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, int | float):
            raise ValueError(f"watermark: must be a float (got {type(self.watermark).__name__})")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1) (got {self.watermark})")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching: must be a bool")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) \
                or not 0 <= threshold <= self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold: must be an int in "
                             f"[0, max_model_len={self.max_model_len}] (got {threshold!r})")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras: must be an int >= 0 (got {self.max_loras!r})")
        if isinstance(self.lora_load_ms, bool) or not isinstance(self.lora_load_ms, int | float) \
                or not 0.0 <= self.lora_load_ms <= 60_000.0:
            raise ValueError(f"lora_load_ms: must be a number of ms in [0, 60000] (got {self.lora_load_ms!r})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_num_seqs ({self.max_num_seqs}) "
                f"(got {self.max_num_batched_tokens})")
        max_request_blocks = -(-self.max_model_len // self.block_size)
        usable_blocks = self.num_gpu_blocks - self.watermark_blocks
        if max_request_blocks > usable_blocks:
            raise ValueError(
                f"max_model_len: {self.max_model_len} tokens need {max_request_blocks} blocks, "
                f"more than the {usable_blocks} usable beside the watermark; "
                f"must be <= {usable_blocks * self.block_size}")

    def _check_hardware(self) -> None:
        if not isinstance(self.gpu, str) or len(self.gpu) > MAX_GPU_NAME_CHARS:
            raise ValueError(f"gpu: must be a string of at most {MAX_GPU_NAME_CHARS} characters "
                             f"(got {self.gpu!r})")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size: must be an int in [1, {MAX_TENSOR_PARALLEL_SIZE}] "
                             f"(got {size!r})")
        if self.interconnect not in INTERCONNECTS:
            raise ValueError(f"interconnect: must be one of {', '.join(INTERCONNECTS)} "
                             f"(got {self.interconnect!r})")

    @property
    def has_nvlink(self) -> bool:
        """Whether the instance's GPUs exchange activations over NVLink."""
        return self.interconnect == "nvlink"

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free when admitting a new prefill (vLLM rounds down)."""
        return int(self.watermark * self.num_gpu_blocks)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.num_gpu_blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (msgpack- and JSON-able)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from a dict; unknown keys are ignored, missing ones take the defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})
