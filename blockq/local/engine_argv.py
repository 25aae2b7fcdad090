"""The engine part of a local cluster's configuration: its validation, and the worker options
that choose and configure each worker process's engine (emulated, embedded vLLM, or a running
vLLM server over HTTP)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from blockq.config import ConfigError

if TYPE_CHECKING:
    from blockq.local.cluster_config import ClusterConfig

ENGINES = ("emulated", "vllm", "vllm-http")


def check_engine(config: ClusterConfig) -> None:
    """The engine settings of ``config``, validated (the error names the setting)."""
    if config.engine not in ENGINES:
        raise ConfigError(f"engine: must be one of {', '.join(ENGINES)} (got {config.engine!r})")
    if config.engine == "vllm" and not config.model:
        raise ConfigError("model: required with engine vllm (a model path or name)")
    if config.engine == "vllm-http":
        if not config.vllm_urls:
            raise ConfigError("vllm_urls: required with engine vllm-http (the servers, http://host:port)")
        if config.instances != len(config.vllm_urls):
            raise ConfigError(f"instances: must be the number of vllm_urls with engine vllm-http "
                              f"({len(config.vllm_urls)}; got {config.instances})")
    if config.vllm_kv_events_urls:
        if config.engine != "vllm-http" or len(config.vllm_kv_events_urls) != len(config.vllm_urls):
            raise ConfigError(f"vllm_kv_events_urls: with engine vllm-http only, one a server "
                              f"({len(config.vllm_urls)} vllm_urls; got {len(config.vllm_kv_events_urls)})")
        if not config.model:
            raise ConfigError("model: required with vllm_kv_events_urls (the served model's directory: "
                              "prompts are hashed with its tokenizer)")
    if not isinstance(config.prefix_caching, bool):
        raise ConfigError(f"prefix_caching: must be true or false (got {config.prefix_caching!r})")
    for name in ("vllm_block_size", "vllm_kv_cache_bytes", "vllm_max_model_len", "vllm_max_num_seqs",
                 "vllm_max_loras"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}: must be a positive integer (got {value!r})")
    utilization = config.vllm_gpu_memory_utilization
    if utilization is not None and (isinstance(utilization, bool) or not isinstance(utilization, int | float)
                                    or not 0 < utilization <= 1):
        raise ConfigError(f"vllm_gpu_memory_utilization: must be in (0, 1] (got {utilization!r})")


def engine_argv(config: ClusterConfig, process_index: int, preset: str) -> list[str]:
    """The worker options that choose and configure the engine of worker process
    ``process_index`` (with vLLM, one instance a process)."""
    prefix = ["--prefix-caching"] if config.prefix_caching else []
    if config.engine == "emulated":
        return ["--preset", preset, "--time-scale", str(config.time_scale), "--noise", str(config.noise), *prefix]
    profile = ["--profile", config.preset] if config.preset.endswith(".json") else []  # the latency model published
    if config.engine == "vllm-http":
        limits = [] if config.vllm_max_num_seqs is None else ["--max-num-seqs", str(config.vllm_max_num_seqs)]
        if config.vllm_max_loras is not None:  # the servers' own, until their /metrics say
            limits += ["--max-loras", str(config.vllm_max_loras)]
        events = ["--kv-events-url", config.vllm_kv_events_urls[process_index], "--model", str(config.model)] \
            if config.vllm_kv_events_urls else []
        return ["--engine", "vllm-http", "--url", config.vllm_urls[process_index], *profile, *limits, *events]
    argv = ["--engine", "vllm", "--model", str(config.model), *prefix, *profile]
    for option, value in (("--block-size", config.vllm_block_size), ("--kv-cache-bytes", config.vllm_kv_cache_bytes),
                          ("--gpu-memory-utilization", config.vllm_gpu_memory_utilization),
                          ("--max-model-len", config.vllm_max_model_len),
                          ("--max-num-seqs", config.vllm_max_num_seqs),
                          ("--lora-modules", config.vllm_lora_modules), ("--max-loras", config.vllm_max_loras)):
        if value is not None:
            argv += [option, str(value)]
    if config.vllm_pin_cores:
        argv += ["--cpu-core", str(process_index % (os.cpu_count() or 1))]
    return argv + (["--enforce-eager"] if config.vllm_enforce_eager else [])
