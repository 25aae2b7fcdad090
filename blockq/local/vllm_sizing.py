"""How ``blockq up`` sizes vLLM instances on a CPU node, and the checks that refuse, at
once and naming the option, a configuration that cannot start (docs/engines.md, "Sizing
vLLM on a CPU node").

On the CPU backend vLLM's ``gpu_memory_utilization`` (default 0.92) is a fraction of the
*node's* memory, asked by every instance: two instances ask 184 %, the second fails, and
a supervisor restarting it never gets further. So ``up`` gives each instance an explicit
KV cache size (``--kv-cache-bytes``, vLLM's ``kv_cache_memory_bytes``) cut from the free
memory shared among the instances, after their weights and runtime.

:func:`size_cpu_instances` is the rule, pure: the node and the model are measured by
:func:`measure_node` and :func:`read_model_shape` (the I/O) and handed in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockq.config import ConfigError

GiB = 1 << 30
MiB = 1 << 20
# vllm/v1/attention/backends/cpu_attn.py, get_supported_kernel_block_sizes: MultipleOf(32);
# another size finds no kernel ("No common block size", vllm/v1/worker/utils.py).
CPU_BLOCK_MULTIPLE = 32
# vllm/platforms/cpu.py, check_and_update_config: what vLLM-CPU picks when none is given.
CPU_DEFAULT_BLOCK_SIZE = 128
# The worker's max_num_seqs when none is given (workers/engines/vllm.py takes it from here).
DEFAULT_MAX_NUM_SEQS = 48
# What an instance holds besides weights and KV cache: the worker process with vLLM and
# torch imported, and vLLM's engine-core process (torch, oneDNN buffers, the activations
# of a step). Measured here on the tiny model (tests/test_vllm_defaults.py prints it): 2.2 GiB
# resident for a worker and its vLLM processes with 0.19 GiB of KV cache, shared library
# pages counted once a process.
INSTANCE_RUNTIME_BYTES = 2 * GiB
# Left to everything else on the node: Redis, dispatcher, predictor, gateway, the OS, and
# the free memory moving between the measure and the allocation.
NODE_RESERVE_FRACTION = 0.10
NODE_RESERVE_MIN_BYTES = 1 * GiB
# vLLM-CPU's legacy KV size in GiB: when set it replaces kv_cache_memory_bytes
# (vllm/platforms/cpu.py, check_and_update_config), so the worker drops it when it is
# given --kv-cache-bytes, and `up` sizes nothing while it is set.
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class NodeMemory:
    """The node's memory as ``up`` found it, in bytes; ``kv_cache_env_gib``: the
    ``VLLM_CPU_KVCACHE_SPACE`` set in the environment (None: not set)."""

    available_bytes: int
    total_bytes: int
    kv_cache_env_gib: int | None = None


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a model directory. ``kv_bytes_per_token``: K and V of every
    layer for one token (None: its config does not say, then no minimum or cap is
    checked); ``max_position_embeddings``: vLLM's default ``max_model_len`` (None: not
    known, e.g. with rope scaling)."""

    weights_bytes: int
    kv_bytes_per_token: int | None = None
    max_position_embeddings: int | None = None


@dataclass(frozen=True)
class VllmWanted:
    """The vLLM options as given (None: not given). ``num_instances``: how many instances
    share the node (under autoscale, the most the fleet may reach)."""

    num_instances: int
    block_size: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class VllmSizing:
    """What ``up`` passes to every instance (None: leave it to the option given or to
    vLLM), and one line saying how it was chosen."""

    block_size: int | None
    kv_cache_bytes: int | None
    reason: str


def size_cpu_instances(wanted: VllmWanted, node: NodeMemory, model: ModelShape) -> VllmSizing:
    """The block size and KV cache size of each instance on a CPU node; ConfigError naming
    the option to change when the configuration cannot start. Explicit options win: a
    ``kv_cache_bytes``, a ``VLLM_CPU_KVCACHE_SPACE`` or a ``gpu_memory_utilization`` is
    checked, not replaced."""
    block_size = _check_block_size(wanted.block_size)
    max_model_len = _check_max_model_len(wanted.max_model_len, model)
    min_kv_bytes = _min_kv_bytes(model, max_model_len, block_size)
    given_block_size = None if wanted.block_size is not None else block_size
    if wanted.kv_cache_bytes is not None or node.kv_cache_env_gib is not None:
        return _check_explicit_kv(wanted, node, model, min_kv_bytes, given_block_size)
    if wanted.gpu_memory_utilization is not None:
        return _check_utilization(wanted, node, model, min_kv_bytes, given_block_size)
    return _default_kv(wanted, node, model, max_model_len, min_kv_bytes, given_block_size)


def _check_block_size(block_size: int | None) -> int:
    if block_size is None:
        return CPU_DEFAULT_BLOCK_SIZE
    if block_size % CPU_BLOCK_MULTIPLE:
        raise ConfigError(f"--block-size: vLLM's CPU attention needs a multiple of {CPU_BLOCK_MULTIPLE} tokens "
                          f"(got {block_size}; leave it out for {CPU_DEFAULT_BLOCK_SIZE})")
    return block_size


def _check_max_model_len(max_model_len: int | None, model: ModelShape) -> int | None:
    """The max_model_len vLLM will run (None: not known)."""
    limit = model.max_position_embeddings
    if max_model_len is not None and limit is not None and max_model_len > limit:
        raise ConfigError(f"--max-model-len: {max_model_len} is past the model's max_position_embeddings ({limit})")
    return max_model_len if max_model_len is not None else limit


def _min_kv_bytes(model: ModelShape, max_model_len: int | None, block_size: int) -> int | None:
    """The KV cache of one max_model_len sequence in whole blocks: less and vLLM refuses to
    start (vllm/v1/core/kv_cache_utils.py, check_enough_kv_cache_memory)."""
    if model.kv_bytes_per_token is None or max_model_len is None:
        return None
    return math.ceil(max_model_len / block_size) * block_size * model.kv_bytes_per_token


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def _check_explicit_kv(wanted: VllmWanted, node: NodeMemory, model: ModelShape, min_kv_bytes: int | None,
                       block_size: int | None) -> VllmSizing:
    if wanted.kv_cache_bytes is not None:
        option, kv_bytes = "--kv-cache-bytes", wanted.kv_cache_bytes
    else:
        option, kv_bytes = KV_CACHE_ENV, (node.kv_cache_env_gib or 0) * GiB
    if min_kv_bytes is not None and kv_bytes < min_kv_bytes:
        raise ConfigError(f"{option}: {kv_bytes} bytes of KV cache are less than one --max-model-len sequence "
                          f"needs ({min_kv_bytes} bytes); raise {option} or lower --max-model-len")
    # No reserve here: the node's free memory itself is the limit an explicit size must fit.
    need_bytes = wanted.num_instances * (kv_bytes + model.weights_bytes + INSTANCE_RUNTIME_BYTES)
    if need_bytes > node.available_bytes:
        raise ConfigError(f"{option}: {wanted.num_instances} instances of {_gib(kv_bytes)} KV cache + "
                          f"{_gib(model.weights_bytes)} weights + {_gib(INSTANCE_RUNTIME_BYTES)} runtime need "
                          f"{_gib(need_bytes)}, the node has {_gib(node.available_bytes)} free; lower {option} "
                          f"or --instances")
    return VllmSizing(block_size, None, f"{option} as given: {_gib(kv_bytes)} of KV cache an instance")


def _check_utilization(wanted: VllmWanted, node: NodeMemory, model: ModelShape, min_kv_bytes: int | None,
                       block_size: int | None) -> VllmSizing:
    """vLLM-CPU takes ``utilization`` of the node's *total* memory for each instance and
    refuses when that is past the free memory (vllm/v1/worker/cpu_worker.py)."""
    utilization = wanted.gpu_memory_utilization or 0.0
    per_instance = math.ceil(node.total_bytes * utilization)
    if wanted.num_instances * per_instance > node.available_bytes:
        raise ConfigError(f"--gpu-memory-utilization: on a CPU it is a share of the node's memory for each "
                          f"instance: {wanted.num_instances} x {utilization} x {_gib(node.total_bytes)} is past the "
                          f"{_gib(node.available_bytes)} free; lower it, or leave it out and `up` sizes the KV cache")
    kv_bytes = per_instance - model.weights_bytes - INSTANCE_RUNTIME_BYTES
    if min_kv_bytes is not None and kv_bytes < min_kv_bytes:
        raise ConfigError(f"--gpu-memory-utilization: {utilization} of the node leaves {_gib(max(0, kv_bytes))} "
                          f"for KV cache after the weights and runtime, less than one --max-model-len sequence "
                          f"needs ({min_kv_bytes} bytes)")
    return VllmSizing(block_size, None, f"--gpu-memory-utilization as given: {_gib(per_instance)} an instance")


def _default_kv(wanted: VllmWanted, node: NodeMemory, model: ModelShape, max_model_len: int | None,
                min_kv_bytes: int | None, block_size: int | None) -> VllmSizing:
    """The free memory less a reserve, shared evenly, less weights and runtime; at most
    what max_num_seqs sequences of max_model_len can fill (more would never be used, and
    a CPU cache is zeroed page by page at start-up)."""
    reserve_bytes = max(NODE_RESERVE_MIN_BYTES, int(node.available_bytes * NODE_RESERVE_FRACTION))
    share_bytes = (node.available_bytes - reserve_bytes) // wanted.num_instances
    room_bytes = share_bytes - model.weights_bytes - INSTANCE_RUNTIME_BYTES
    if room_bytes < (min_kv_bytes or MiB):
        need = f"one --max-model-len sequence's {_gib(min_kv_bytes)} of KV cache" if min_kv_bytes else "a KV cache"
        raise ConfigError(f"--instances: {wanted.num_instances} vLLM instances do not fit this node: "
                          f"{_gib(node.available_bytes)} free, less a {_gib(reserve_bytes)} reserve, gives each "
                          f"{_gib(share_bytes)}, short of its {_gib(model.weights_bytes)} weights, "
                          f"{_gib(INSTANCE_RUNTIME_BYTES)} runtime and {need}; lower --instances or "
                          f"--max-model-len, or give --kv-cache-bytes")
    kv_bytes = room_bytes
    if model.kv_bytes_per_token is not None and max_model_len is not None:
        num_seqs = wanted.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        kv_bytes = min(kv_bytes, num_seqs * (min_kv_bytes or 0))
    return VllmSizing(block_size, kv_bytes,
                      f"{_gib(node.available_bytes)} free, {wanted.num_instances} instances: {_gib(kv_bytes)} of "
                      f"KV cache each (block size {block_size or wanted.block_size})")


# --- the I/O: what the node and the model directory hold ------------------------------


def measure_node(environ: dict[str, str] | None = None) -> NodeMemory:
    """The node's free and total memory now, and ``VLLM_CPU_KVCACHE_SPACE`` if set."""
    import psutil

    environ = dict(os.environ) if environ is None else environ
    memory = psutil.virtual_memory()
    raw = environ.get(KV_CACHE_ENV, "")
    if raw and not raw.isdigit():
        raise ConfigError(f"{KV_CACHE_ENV}: must be a whole number of GiB (got {raw!r})")
    return NodeMemory(int(memory.available), int(memory.total), int(raw) if raw else None)


def read_model_shape(model: str) -> ModelShape:
    """The weights (the sizes of its weight files) and KV shape (its ``config.json``) of
    the model directory ``model``; ConfigError naming ``--model`` when it is not one."""
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--model: no model directory at {model} (on a CPU node `blockq up` sizes vLLM "
                          f"from the model's files: give a local Hugging Face model directory)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model: {model} has no readable config.json ({exc})") from None
    weights_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    if not weights_bytes:
        raise ConfigError(f"--model: {model} holds no weights (*.safetensors or *.bin)")
    return model_shape_from_config(config, weights_bytes)


def model_shape_from_config(config: dict[str, Any], weights_bytes: int) -> ModelShape:
    """The KV bytes a token takes, 2 (K and V) x layers x KV heads x head size x the
    dtype's bytes (2 unless the checkpoint is float32), from a Hugging Face config (a
    multimodal one's ``text_config``)."""
    text = config.get("text_config")
    values = {**config, **text} if isinstance(text, dict) else config
    layers, heads, hidden = (_positive_int(values, name) for name in
                             ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    kv_heads = _positive_int(values, "num_key_value_heads") or heads
    head_dim = _positive_int(values, "head_dim") or (hidden // heads if hidden and heads else None)
    dtype_bytes = 4 if (values.get("torch_dtype") or values.get("dtype")) == "float32" else 2
    per_token = 2 * layers * kv_heads * head_dim * dtype_bytes if layers and kv_heads and head_dim else None
    # Rope scaling stretches the positions past the config's figure: then it is not known.
    positions = None if values.get("rope_scaling") else _positive_int(values, "max_position_embeddings")
    return ModelShape(weights_bytes, per_token, positions)


def _positive_int(values: dict[str, Any], name: str) -> int | None:
    value = values.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def vllm_runs_on_cpu() -> bool:
    """True with the CPU build of vLLM installed (``vllm-cpu``, what ``make vllm`` takes
    here); ConfigError when no vLLM is installed: its workers could not start."""
    from importlib import metadata

    for name, on_cpu in (("vllm-cpu", True), ("vllm", False)):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return on_cpu
    raise ConfigError("--engine vllm: vLLM is not installed in this environment (`make vllm`, then run "
                      ".venv-vllm/bin/blockq)")


# vLLM's start-up refusals, by a phrase of their message (as its engine-core process logs
# it), and the `blockq up` option that changes the outcome.
VLLM_REFUSAL_OPTIONS = (
    ("max seq len", "--kv-cache-bytes (or a lower --max-model-len)"),
    ("No available memory for the cache blocks", "--kv-cache-bytes"),
    ("requested memory for kv", "--kv-cache-bytes (or free memory)"),
    ("desired CPU memory utilization", "--gpu-memory-utilization (or leave it out)"),
    ("User-specified max_model_len", "--max-model-len"),
    ("No common block size", "--block-size"),
)


def explain_vllm_refusal(log_lines: list[str], max_chars: int = 400) -> str | None:
    """``OPTION: vLLM's line`` for the last line of ``log_lines`` (a worker's log) in
    which vLLM refuses to start for a reason an option changes; None if there is none."""
    for line in reversed(log_lines):
        for phrase, option in VLLM_REFUSAL_OPTIONS:
            if phrase in line:
                return f"{option}: {line.strip()[:max_chars]}"
    return None
