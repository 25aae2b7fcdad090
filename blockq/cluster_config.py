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

With a ``[cluster.autoscale]`` table (or ``blockq up --autoscale``) the dispatcher leader
sizes the fleet (:class:`blockq.config.AutoscaleOptions`: ``scaler``, ``min_instances``,
``max_instances``, ``startup_s``, ``cycle_s``, ``cooldown_s``, ...) and the supervisor
follows it: every instance is then its own worker process, and ``instances`` (default
``min_instances``) is the size the fleet starts at::

    [cluster.autoscale]
    scaler = "predictive"
    min_instances = 1
    max_instances = 8
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from blockq.config import AutoscaleOptions, ConfigError
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
    autoscale: AutoscaleOptions | None = None

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
        bounds = self.autoscale
        if bounds is not None and not bounds.min_instances <= self.instances <= bounds.max_instances:
            raise ConfigError(f"instances: must be between min_instances ({bounds.min_instances}) and "
                              f"max_instances ({bounds.max_instances}) under autoscale (got {self.instances})")

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
        per process keeps a crash or an out-of-memory error to one instance), and one
        under autoscale (the supervisor starts and drains instances one by one)."""
        return 1 if self.engine == "vllm" or self.autoscale is not None else self.instances_per_process

    @property
    def num_worker_processes(self) -> int:
        return math.ceil(self.instances / self.instances_per_worker_process)

    def with_overrides(self, **overrides: Any) -> ClusterConfig:
        """A copy with every override that is not None applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_toml(cls, path: Path) -> ClusterConfig:
        section = dict(cls.toml_section(path))
        if "autoscale" in section:
            table = section["autoscale"]
            known = {f.name for f in fields(AutoscaleOptions)}
            unknown = sorted(set(table) - known) if isinstance(table, dict) else ["(not a table)"]
            if unknown:
                raise ConfigError(f"config: unknown keys in [cluster.autoscale]: {', '.join(unknown)}")
            section["autoscale"] = AutoscaleOptions(**table)
        return cls(**section)

    @classmethod
    def toml_section(cls, path: Path) -> dict[str, Any]:
        """The ``[cluster]`` table of ``path`` as written (unknown keys refused)."""
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config: file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: {path}: {exc}") from None
        section = data.get("cluster", {})
        unknown = sorted(set(section) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"config: unknown keys in [cluster]: {', '.join(unknown)}")
        return section

    def child_argvs(self, *, workers: bool = True) -> list[tuple[str, tuple[str, ...]]]:
        """(name, python -m argv) of every service to start (``workers`` False: all but the
        workers, which the supervisor starts itself under autoscale: :meth:`worker_child`)."""
        children: list[tuple[str, tuple[str, ...]]] = []
        predictor = ["predictor_service", "--backend", self.predictor_backend]
        if self.predictor_model:
            predictor += ["--model-dir", self.predictor_model]
        children.append(("predictor", tuple(predictor)))
        dispatcher = ["dispatcher", "--policy", self.policy, "--seed", str(self.seed)]
        if self.objective:
            dispatcher += ["--objective", self.objective]
        children.append(("dispatcher", (*dispatcher, *self._autoscale_argv())))
        per_process = self.instances_per_worker_process
        for process_index in range(self.num_worker_processes if workers else 0):
            first = process_index * per_process
            children.append(self.worker_child(process_index, first, min(per_process, self.instances - first)))
        if self.gateway:
            gateway = ["blockq.gateway", "--host", self.gateway_host, "--port", str(self.gateway_port)]
            if self.gateway_allow_unauthenticated:
                gateway.append("--allow-unauthenticated")
            children.append(("gateway", tuple(gateway)))
        if self.batch_worker:
            children.append(("batch-worker", ("blockq.batch", "worker")))
        return children

    def worker_child(self, process_index: int, first_index: int, count: int) -> tuple[str, tuple[str, ...]]:
        """(name, argv) of the worker process ``workers-{process_index}`` serving
        instances ``first_index`` .. ``first_index + count - 1``."""
        return (f"workers-{process_index}", (
            "workers", "--instance-id", self.instance_prefix, "--instances", str(count),
            "--first-index", str(first_index), *self._engine_argv(), "--seed", str(self.seed)))

    def instance_id(self, index: int) -> str:
        """The id of instance ``index`` (as ``python -m workers --instances`` names it)."""
        return f"{self.instance_prefix}-{index}"

    def _autoscale_argv(self) -> list[str]:
        """The dispatcher options that turn autoscaling on (none without it)."""
        options = self.autoscale
        if options is None:
            return []
        argv = ["--autoscale", options.scaler, "--min-instances", str(options.min_instances),
                "--max-instances", str(options.max_instances), "--startup-s", str(options.startup_s),
                "--cycle-s", str(options.cycle_s), "--cooldown-s", str(options.cooldown_s),
                "--reversal-hold-s", str(options.reversal_hold_s),
                "--max-step-fraction", str(options.max_step_fraction),
                "--scale-command-timeout-s", str(options.scale_command_timeout_s)]
        if options.scale_command:
            argv.append(f"--scale-command={options.scale_command}")  # one argument, even if it starts with -
        if options.metrics_port is not None:
            argv += ["--metrics-port", str(options.metrics_port), "--metrics-host", options.metrics_host]
        return argv

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
