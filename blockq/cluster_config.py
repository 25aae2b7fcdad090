"""What ``blockq up`` starts: a frozen, validated description of a local cluster, read
from a TOML file (``--config``) and overridden by command-line flags.

Example ``cluster.toml``::

    [cluster]
    instances = 12
    instances_per_process = 6
    policy = "block"
    preset = "llama2-7b-a30"
    time_scale = 1.0
    predictor_backend = "heuristic"   # or "fast" with predictor_model = "models/fast"
    gateway = false
    gateway_allow_unauthenticated = false   # needed to bind a non-loopback host without API keys
    redis_maxmemory = "1gb"   # embedded Redis only; noeviction: writes fail when it is full

With ``engine = "vllm"`` the instances run vLLM on ``model`` (a path or model name),
one instance per worker process; ``vllm_block_size``, ``vllm_kv_cache_bytes``,
``vllm_gpu_memory_utilization``, ``vllm_max_model_len`` and ``vllm_max_num_seqs`` pass
through to vLLM when set (``vllm_enforce_eager = true``: no graph capture or compilation,
for a fast start-up),
and ``preset``, ``time_scale`` and ``noise`` (the emulated engine's) are not used.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from blockq.config import ConfigError
from blockq.embedded_redis import DEFAULT_MAXMEMORY, check_maxmemory

ENGINES = ("emulated", "vllm")


@dataclass(frozen=True)
class ClusterConfig:
    instances: int = 2
    instances_per_process: int = 6
    instance_prefix: str = "inst"
    policy: str = "round_robin"
    objective: str | None = None
    preset: str = "llama2-7b-a30"
    time_scale: float = 1.0
    noise: float = 0.05
    seed: int = 0
    predictor_backend: str = "heuristic"
    predictor_model: str | None = None
    gateway: bool = False
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    gateway_allow_unauthenticated: bool = False
    batch_worker: bool = False
    redis_maxmemory: str = DEFAULT_MAXMEMORY
    engine: str = "emulated"
    model: str | None = None
    vllm_block_size: int | None = None
    vllm_kv_cache_bytes: int | None = None
    vllm_gpu_memory_utilization: float | None = None
    vllm_max_model_len: int | None = None
    vllm_max_num_seqs: int | None = None
    vllm_enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.instances <= 1024:
            raise ConfigError(f"instances: must be between 1 and 1024 (got {self.instances})")
        if not 1 <= self.instances_per_process <= 256:
            raise ConfigError(f"instances_per_process: must be between 1 and 256 (got {self.instances_per_process})")
        if not 0 < self.time_scale <= 1000:
            raise ConfigError(f"time_scale: must be in (0, 1000] (got {self.time_scale})")
        if not 0 <= self.noise <= 1:
            raise ConfigError(f"noise: must be in [0, 1] (got {self.noise})")
        if not 1 <= self.gateway_port <= 65535:
            raise ConfigError(f"gateway_port: must be a TCP port (got {self.gateway_port})")
        check_maxmemory(self.redis_maxmemory)
        self._check_engine()

    def _check_engine(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: must be one of {', '.join(ENGINES)} (got {self.engine!r})")
        if self.engine == "vllm" and not self.model:
            raise ConfigError("model: required with engine vllm (a model path or name)")
        for name in ("vllm_block_size", "vllm_kv_cache_bytes", "vllm_max_model_len", "vllm_max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: must be a positive integer (got {value!r})")
        utilization = self.vllm_gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not isinstance(utilization, int | float)
                                        or not 0 < utilization <= 1):
            raise ConfigError(f"vllm_gpu_memory_utilization: must be in (0, 1] (got {utilization!r})")

    @property
    def instances_per_worker_process(self) -> int:
        """Instances each worker process serves: ``instances_per_process``, but one with
        vLLM, whose engine owns its own engine-core process and GPU memory (one engine
        per process keeps a crash or an out-of-memory error to one instance)."""
        return 1 if self.engine == "vllm" else self.instances_per_process

    @property
    def num_worker_processes(self) -> int:
        return math.ceil(self.instances / self.instances_per_worker_process)

    def with_overrides(self, **overrides: Any) -> ClusterConfig:
        """A copy with every override that is not None applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_toml(cls, path: Path) -> ClusterConfig:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config: file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: {path}: {exc}") from None
        section = data.get("cluster", {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"config: unknown keys in [cluster]: {', '.join(unknown)}")
        return cls(**section)

    def child_argvs(self) -> list[tuple[str, tuple[str, ...]]]:
        """(name, python -m argv) of every service to start."""
        children: list[tuple[str, tuple[str, ...]]] = []
        predictor = ["predictor_service", "--backend", self.predictor_backend]
        if self.predictor_model:
            predictor += ["--model-dir", self.predictor_model]
        children.append(("predictor", tuple(predictor)))
        dispatcher = ["dispatcher", "--policy", self.policy, "--seed", str(self.seed)]
        if self.objective:
            dispatcher += ["--objective", self.objective]
        children.append(("dispatcher", tuple(dispatcher)))
        per_process = self.instances_per_worker_process
        for process_index in range(self.num_worker_processes):
            first = process_index * per_process
            count = min(per_process, self.instances - first)
            children.append((f"workers-{process_index}", (
                "workers", "--instance-id", self.instance_prefix, "--instances", str(count),
                "--first-index", str(first), *self._engine_argv(), "--seed", str(self.seed))))
        if self.gateway:
            gateway = ["blockq.gateway", "--host", self.gateway_host, "--port", str(self.gateway_port)]
            if self.gateway_allow_unauthenticated:
                gateway.append("--allow-unauthenticated")
            children.append(("gateway", tuple(gateway)))
        if self.batch_worker:
            children.append(("batch-worker", ("blockq.batch", "worker")))
        return children

    def _engine_argv(self) -> list[str]:
        """The worker options that choose and configure its engine."""
        if self.engine == "emulated":
            return ["--preset", self.preset, "--time-scale", str(self.time_scale), "--noise", str(self.noise)]
        argv = ["--engine", "vllm", "--model", str(self.model)]
        for option, value in (("--block-size", self.vllm_block_size), ("--kv-cache-bytes", self.vllm_kv_cache_bytes),
                              ("--gpu-memory-utilization", self.vllm_gpu_memory_utilization),
                              ("--max-model-len", self.vllm_max_model_len),
                              ("--max-num-seqs", self.vllm_max_num_seqs)):
            if value is not None:
                argv += [option, str(value)]
        return argv + (["--enforce-eager"] if self.vllm_enforce_eager else [])
