"""What a worker asks of its vLLM engine: :class:`VllmEngineOptions` and the command-line
options that set them (``blockq worker`` / ``up``, ``profile``, ``fidelity``).

On a CPU, ``blockq up`` chooses the block size and KV cache size when they are not given
(blockq/local/vllm_sizing.py, docs/engines.md "Sizing vLLM on a CPU node"); these options
only carry them to vLLM.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from blockq.local.vllm_sizing import DEFAULT_MAX_NUM_SEQS, KV_CACHE_ENV

# vLLM-CPU's list of cores for its OpenMP kernel threads (vllm/envs.py; default: auto).
CPU_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class VllmEngineOptions:
    """What the worker asks of vLLM; None leaves vLLM's own default (and what it chose is
    read back after start-up). ``kv_cache_bytes`` fixes the KV cache size (on CPU the
    only sizing that does not depend on the machine's free memory; it wins over a
    ``VLLM_CPU_KVCACHE_SPACE`` in the environment, :meth:`apply_to_environment`);
    ``gpu_memory_utilization`` is the fraction of device memory (on CPU: of the node's)
    vLLM may take. ``enable_prefix_caching`` True turns vLLM's prefix cache on (None:
    vLLM's default, on in V1 for most models; the beats' engine config says which).
    ``cpu_core``: on the CPU backend, the one core vLLM runs its kernels on (instances
    sharing a node then do not share cores; None: vLLM's own binding).
    ``lora_modules``: LoRA adapters served beside the base model, (name, path) pairs: vLLM
    runs with ``enable_lora``, at most ``max_loras`` resident (and ``max_cpu_loras`` the
    same: a load reads the adapter from disk), of rank at most ``max_lora_rank``.
    ``served_model_name``: the base model's name in beats and requests (None:
    ``vllm:<model path>``)."""

    model: str | None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    cpu_core: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: --model PATH is required for --engine vllm")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or not all(names) or not all(path for _, path in self.lora_modules):
            raise ValueError("lora_modules: NAME=PATH pairs with distinct non-empty names")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras, max_lora_rank: must be >= 1 (got {self.max_loras}, {self.max_lora_rank})")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1 (got {value})")
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1] (got {utilization})")
        if self.cpu_core is not None and self.cpu_core < 0:
            raise ValueError(f"cpu_core: must be >= 0 (got {self.cpu_core})")

    @classmethod
    def from_args(cls, args: Any, enable_prefix_caching: bool | None = None) -> VllmEngineOptions:
        """From the options :func:`add_vllm_engine_arguments` adds (and ``--model``)."""
        return cls(model=args.model, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, block_size=args.block_size,
                   kv_cache_bytes=args.kv_cache_bytes,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   enforce_eager=args.enforce_eager, enable_prefix_caching=enable_prefix_caching,
                   cpu_core=getattr(args, "cpu_core", None), lora_modules=tuple(getattr(args, "lora_modules", ())),
                   max_loras=getattr(args, "max_loras", 1), max_lora_rank=getattr(args, "max_lora_rank", 16),
                   served_model_name=getattr(args, "served_model_name", None))

    def apply_to_environment(self, environ: Any = os.environ) -> None:
        """Drop ``VLLM_CPU_KVCACHE_SPACE`` when a KV cache size is given: vLLM-CPU lets it
        replace ``kv_cache_memory_bytes`` (vllm/platforms/cpu.py, check_and_update_config),
        and the option, chosen for this instance, must win; bind vLLM-CPU's kernel threads
        to ``cpu_core``. Call before building the engine (its engine-core process inherits
        the environment)."""
        if self.kv_cache_bytes is not None:
            environ.pop(KV_CACHE_ENV, None)
        if self.cpu_core is not None:
            environ[CPU_THREADS_BIND_ENV] = str(self.cpu_core)

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model": self.model, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "enable_chunked_prefill": True,
            "enforce_eager": self.enforce_eager, "disable_log_stats": False,
            "enable_logging_iteration_details": True}
        optional = {"max_model_len": self.max_model_len, "block_size": self.block_size,
                    "kv_cache_memory_bytes": self.kv_cache_bytes,
                    "gpu_memory_utilization": self.gpu_memory_utilization,
                    "enable_prefix_caching": self.enable_prefix_caching}
        args.update({name: value for name, value in optional.items() if value is not None})
        if self.lora_modules:
            args.update(enable_lora=True, max_loras=self.max_loras, max_cpu_loras=self.max_loras,
                        max_lora_rank=self.max_lora_rank)
        return args


def add_vllm_engine_arguments(parser: Any, for_one_engine: bool = False) -> None:
    """The vLLM engine options of ``blockq worker`` / ``up``, ``profile`` and ``fidelity``.

    ``for_one_engine``: a measurement run (profile, fidelity) defaults to eager mode, as
    compiling the model on CPU takes minutes and changes nothing the runs measure.
    """
    vllm = parser.add_argument_group("vLLM engine (None: vLLM's default; what it chose is read back)")
    vllm.add_argument("--max-num-seqs", type=int, default=VllmEngineOptions.max_num_seqs)
    vllm.add_argument("--max-num-batched-tokens", type=int, default=VllmEngineOptions.max_num_batched_tokens)
    vllm.add_argument("--max-model-len", type=int, default=None)
    vllm.add_argument("--block-size", type=int, default=None,
                      help="KV block size in tokens (vLLM's CPU attention: a multiple of 32; `up` on CPU: 128)")
    vllm.add_argument("--kv-cache-bytes", type=int, default=None, help="fixed KV cache size in bytes (wins over VLLM_CPU_KVCACHE_SPACE; `up` on CPU "
                           "sizes it from free memory when none is given)")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=None,
                      help="fraction of device memory (on CPU: of node memory) vLLM may use")
    if for_one_engine:
        vllm.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                          help="no CUDA graphs / compilation (default here: on)")
    else:
        vllm.add_argument("--enforce-eager", action="store_true",
                          help="no CUDA graphs / compilation (faster start-up)")
        vllm.add_argument("--lora-modules", type=_lora_modules, default=(), metavar="NAME=PATH,...",
                          help="LoRA adapters to serve beside the base model (vLLM --enable-lora)")
        vllm.add_argument("--max-loras", type=int, default=VllmEngineOptions.max_loras,
                          help="LoRA adapters resident and in one batch at most (vLLM's max_loras)")
        vllm.add_argument("--max-lora-rank", type=int, default=VllmEngineOptions.max_lora_rank)
        vllm.add_argument("--served-model-name", default=None,
                          help="the base model's name in beats and requests (default: vllm:<model path>)")
        vllm.add_argument("--cpu-core", type=int, default=None,
                          help="CPU backend: run vLLM's kernels on this one core (`up --pin-cores` gives "
                               "instance K core K modulo the node's cores)")


def _lora_modules(text: str) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH,...`` (argparse type)."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules: {part!r} is not NAME=PATH")
        pairs.append((name, path))
    return tuple(pairs)
