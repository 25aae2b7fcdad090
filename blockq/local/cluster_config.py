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

With ``engine = "vllm-http"`` each instance is a worker driving the running vLLM server at
one of ``vllm_urls`` over its OpenAI API (``instances`` = their number; ``vllm_max_num_seqs``
should be the servers'; ``vllm_kv_events_urls``, one a server, where each publishes its KV cache
events, with ``model`` the served model's directory: prefix hits are then predicted on them). With ``engine = "vllm"`` the instances run vLLM on ``model`` (a path or model name),
one instance per worker process; ``vllm_block_size``, ``vllm_kv_cache_bytes``,
``vllm_gpu_memory_utilization``, ``vllm_max_model_len`` and ``vllm_max_num_seqs`` pass
through to vLLM when set (``vllm_enforce_eager = true``: no graph capture or compilation,
for a fast start-up; ``vllm_pin_cores = true``: on the CPU backend instance K runs its
kernels on core K modulo the node's cores); ``engine_nice = N`` runs the workers and their
engines N steps nicer, so that on a node they share with the dispatcher, Redis and clients
(a small CPU machine) the engines yield to those; on a CPU node ``blockq up`` chooses the block size and KV cache size
that are not set, from the node's free memory (:meth:`ClusterConfig.vllm_wanted`,
blockq/local/vllm_sizing.py); a ``preset`` that is a measured PROFILE.json (``blockq profile``)
is the latency model the instances publish, and ``time_scale`` and ``noise`` (the emulated
engine's) are not used. ``fleet = "6:llama2-7b-a30,2:llama2-7b-h100-tp2"`` (emulated engine,
no autoscale): a mixed fleet, each group's instances in worker processes of their own
started with the group's preset; ``instances`` is the fleet's size and ``preset`` unused
(:mod:`blockq.engine_model.fleet_spec`). With ``cells`` the fleet is split interleaved
(:meth:`~blockq.engine_model.fleet_spec.FleetSpec.split`: every cell the same mix as far as
the counts allow, sizes differing by one at most), and instances are numbered cell by cell:
cell K's are ``inst-F`` ... from F, the earlier cells' sizes summed.

``prefix_caching = true`` turns on every instance's prefix cache (``workers
--prefix-caching``): the emulated engines reuse cached prompt blocks and count hits; vLLM
gets ``enable_prefix_caching=True`` (false leaves vLLM's default, which is on in V1).

With a ``[cluster.autoscale]`` table (or ``blockq up --autoscale``) the dispatcher leader
sizes the fleet (:class:`blockq.config.AutoscaleOptions`: ``scaler``, ``min_instances``,
``max_instances``, ``startup_s``, ``cycle_s``, ``cooldown_s``, ...) and the supervisor
follows it: every instance is then its own worker process, and ``instances`` (default
``min_instances``) is the size the fleet starts at::

    [cluster.autoscale]
    scaler = "predictive"
    min_instances = 1
    max_instances = 8

Every process serves Prometheus metrics (``deploy/METRICS.md``): the dispatcher on
``metrics_base_port`` (default 9400), the predictor on the next port, worker process
``workers-K`` on ``metrics_base_port + 2 + K``, all bound to ``metrics_host`` (default
127.0.0.1); the gateway on its own HTTP port. ``metrics_base_port = 0`` turns them off.
The state file records each URL (``blockq status --json``: ``metrics_urls``).

With ``refine_model`` (a ``blockq predictor refine-train`` directory) the predictor also
serves its HTTP API on ``predictor_http_port`` (default 8100) with ``POST /refine``, and
every worker asks it for remaining-length refinements of its running requests every
``refine_every_tokens`` (64) generated tokens; the beats then carry them to the dispatcher.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from blockq.cells import numbered_cell_prefix
from blockq.config import DEFAULT_REFINE_EVERY_TOKENS, METRICS_OFF, AutoscaleOptions, ConfigError
from blockq.engine_model.fleet_spec import parse_fleet
from blockq.local.embedded_redis import DEFAULT_MAXMEMORY, check_maxmemory
from blockq.local.engine_argv import check_engine, engine_argv
from blockq.local.vllm_sizing import VllmSizing, VllmWanted

MAX_LOCAL_CELLS = 8

DEFAULT_METRICS_BASE_PORT = 9400
# Port offsets from metrics_base_port: the services first, then one per worker process.
METRICS_PORT_OFFSETS = {"dispatcher": 0, "predictor": 1}
WORKER_METRICS_PORT_OFFSET = 2
WORKER_CHILD_PREFIX = "workers-"
# A child's exit status for "these options cannot work, do not restart me" (sysexits'
# EX_CONFIG): `up` stops at its first such exit and reports the line holding the marker.
WILL_NOT_START_EXIT_CODE = 78
WILL_NOT_START_MARKER = "will not start:"


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
    vllm_lora_modules: str | None = None  # NAME=PATH,...: LoRA adapters every vLLM instance serves
    vllm_max_loras: int | None = None
    vllm_enforce_eager: bool = False
    vllm_pin_cores: bool = False
    engine_nice: int = 0  # workers (and their engines' processes) run this much nicer
    vllm_urls: tuple[str, ...] = ()  # engine vllm-http: one instance a server
    vllm_kv_events_urls: tuple[str, ...] = ()  # engine vllm-http: each server's KV events (tcp://host:port)
    prefix_caching: bool = False
    autoscale: AutoscaleOptions | None = None
    metrics_base_port: int = DEFAULT_METRICS_BASE_PORT
    metrics_host: str = "127.0.0.1"
    refine_model: str | None = None
    predictor_http_port: int = 8100
    refine_every_tokens: int = DEFAULT_REFINE_EVERY_TOKENS
    # Cells (blockq.cells): the instances split evenly (a fleet: interleaved) into this many,
    # each with its own predictor, dispatcher and key prefix (cell_prefix); the gateway routes
    # between them.
    cells: int = 1
    fleet: str | None = None  # a mixed fleet, COUNT:PRESET[,...] (blockq.engine_model.fleet_spec)

    def __post_init__(self) -> None:
        self._check_fleet()
        self._check_cells()
        if not 1 <= self.instances <= 1024:
            raise ConfigError(f"instances: must be between 1 and 1024 (got {self.instances})")
        if not 1 <= self.instances_per_process <= 256:
            raise ConfigError(f"instances_per_process: must be between 1 and 256 (got {self.instances_per_process})")
        if not 0 < self.time_scale <= 1000:
            raise ConfigError(f"time_scale: must be in (0, 1000] (got {self.time_scale})")
        if not 0 <= self.noise <= 1:
            raise ConfigError(f"noise: must be in [0, 1] (got {self.noise})")
        if not 0 <= self.engine_nice <= 19:
            raise ConfigError(f"engine_nice: must be between 0 and 19 (got {self.engine_nice})")
        if not 1 <= self.gateway_port <= 65535:
            raise ConfigError(f"gateway_port: must be a TCP port (got {self.gateway_port})")
        check_maxmemory(self.redis_maxmemory)
        check_engine(self)
        self._check_metrics_ports()
        self._check_refinement()
        bounds = self.autoscale
        if bounds is not None and not bounds.min_instances <= self.instances <= bounds.max_instances:
            raise ConfigError(f"instances: must be between min_instances ({bounds.min_instances}) and "
                              f"max_instances ({bounds.max_instances}) under autoscale (got {self.instances})")

    def _check_fleet(self) -> None:
        if self.fleet is None:
            return
        try:
            fleet = parse_fleet(self.fleet)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.engine != "emulated" or self.autoscale is not None:
            raise ConfigError("fleet: a mixed fleet runs emulated engines, without autoscale")
        if self.instances != fleet.num_instances:
            raise ConfigError(f"fleet: {fleet.num_instances} instances, but instances is {self.instances}")

    def _check_cells(self) -> None:
        # Before the metrics ports: counting the worker processes splits the instances.
        if not 1 <= self.cells <= MAX_LOCAL_CELLS:
            raise ConfigError(f"cells: must be between 1 and {MAX_LOCAL_CELLS} (got {self.cells})")
        if self.fleet is not None:  # the fleet decides the cells' sizes
            try:
                parse_fleet(self.fleet).split(self.cells)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif self.instances % self.cells:
            raise ConfigError(f"cells: must be between 1 and {MAX_LOCAL_CELLS} and divide instances "
                              f"(got {self.cells} cells, {self.instances} instances)")
        if self.cells > 1 and (self.autoscale is not None or self.batch_worker):
            raise ConfigError("cells: a local cluster of several cells runs without autoscale and the batch worker")

    def worker_ranges(self) -> list[tuple[int, int, str]]:
        """(first instance index, number of instances, preset) of every worker process, cell
        by cell (:meth:`_cell_worker_ranges`)."""
        return [(first, count, preset) for _, first, count, preset in self._cell_worker_ranges()]

    def _cell_worker_ranges(self) -> list[tuple[int, int, int, str]]:
        """(cell, first instance index, number of instances, preset) of every worker process:
        instances numbered cell by cell, each cell's groups (one without a fleet) in worker
        processes of their own, at most ``instances_per_worker_process`` a process."""
        per_process = self.instances_per_worker_process
        if self.fleet is not None:
            cells = [[(group.num_instances, group.preset) for group in cell_fleet.groups]
                     for cell_fleet in parse_fleet(self.fleet).split(self.cells)]
        else:
            cells = [[(self.instances // self.cells, self.preset)]] * self.cells
        ranges, first = [], 0
        for cell, groups in enumerate(cells):
            for num_instances, preset in groups:
                for offset in range(0, num_instances, per_process):
                    ranges.append((cell, first + offset, min(per_process, num_instances - offset), preset))
                first += num_instances
        return ranges

    def _check_metrics_ports(self) -> None:
        base = self.metrics_base_port
        if isinstance(base, bool) or not isinstance(base, int) or base < 0:
            raise ConfigError(f"metrics_base_port: must be a TCP port, or 0 for no metrics (got {base!r})")
        if base == 0:
            return
        last = self._last_metrics_port()
        if last > 65535:
            num_workers = last - base - WORKER_METRICS_PORT_OFFSET + 1
            raise ConfigError(f"metrics_base_port: {base} leaves no room for {num_workers} worker processes "
                              f"(their ports would reach {last})")
        if self.gateway and base <= self.gateway_port <= last:
            raise ConfigError(f"metrics_base_port: the metrics ports {base}-{last} include gateway_port "
                              f"{self.gateway_port}")
        if not self.metrics_host or any(c.isspace() for c in self.metrics_host):
            raise ConfigError(f"metrics_host: must be a host name or address (got {self.metrics_host!r})")

    def _check_refinement(self) -> None:
        if self.refine_every_tokens < 1:
            raise ConfigError(f"refine_every_tokens: must be >= 1 (got {self.refine_every_tokens})")
        port = self.predictor_http_port
        if not 1 <= port <= 65535:
            raise ConfigError(f"predictor_http_port: must be a TCP port (got {port})")
        if self.refine_model is None:
            return
        base = self.metrics_base_port
        if (self.gateway and port == self.gateway_port) or (base and base <= port <= self._last_metrics_port()):
            raise ConfigError(f"predictor_http_port: {port} is taken by the gateway or a metrics port")

    def _last_metrics_port(self) -> int:
        """The highest port a worker process's metrics may take (under autoscale, the fleet's maximum)."""
        max_workers = self.autoscale.max_instances if self.autoscale is not None else self.num_worker_processes
        return self.metrics_base_port + WORKER_METRICS_PORT_OFFSET + max_workers - 1

    @property
    def refine_url(self) -> str | None:
        """Where workers ask for refinements (None: no refinement model)."""
        return f"http://127.0.0.1:{self.predictor_http_port}" if self.refine_model else None

    def metrics_port(self, child_name: str) -> int | None:
        """The port child ``child_name`` serves ``/metrics`` on; None when metrics are off
        or the child has no port of its own (the gateway serves them on its HTTP port, the
        batch worker has none)."""
        if not self.metrics_base_port:
            return None
        if child_name in METRICS_PORT_OFFSETS:
            return self.metrics_base_port + METRICS_PORT_OFFSETS[child_name]
        index = child_name.removeprefix(WORKER_CHILD_PREFIX)
        if child_name.startswith(WORKER_CHILD_PREFIX) and index.isdigit():
            return self.metrics_base_port + WORKER_METRICS_PORT_OFFSET + int(index)
        return None

    def metrics_url(self, child_name: str) -> str | None:
        """Where child ``child_name``'s metrics are scraped (None: it serves none)."""
        if child_name == "gateway":
            return f"http://{_url_host(self.gateway_host)}:{self.gateway_port}/metrics" if self.gateway else None
        port = self.metrics_port(child_name)
        return f"http://{_url_host(self.metrics_host)}:{port}/metrics" if port is not None else None

    def _metrics_argv(self, child_name: str) -> list[str]:
        # "off" rather than no flag: a BLOCKQ_METRICS_PORT in the supervisor's environment
        # must not hand every child the same port.
        port = self.metrics_port(child_name)
        return ["--metrics-port", str(port) if port is not None else METRICS_OFF, "--metrics-host", self.metrics_host]

    @property
    def instances_per_worker_process(self) -> int:
        """Instances each worker process serves: ``instances_per_process``, but one with
        vLLM, whose engine owns its own engine-core process and GPU memory (one engine
        per process keeps a crash or an out-of-memory error to one instance), and one
        under autoscale (the supervisor starts and drains instances one by one)."""
        return 1 if self.engine != "emulated" or self.autoscale is not None else self.instances_per_process

    @property
    def num_worker_processes(self) -> int:
        return len(self._cell_worker_ranges())

    def cell_prefix(self, cell: int) -> str:
        """Cell ``cell``'s key prefix, hash-tagged (one slot per cell on Redis Cluster)."""
        return numbered_cell_prefix(cell)

    @property
    def cells_setting(self) -> str:
        """``BLOCKQ_CELLS`` for a front on this cluster (empty: one cell)."""
        return " ".join(self.cell_prefix(cell) for cell in range(self.cells)) if self.cells > 1 else ""

    def child_env(self, child_name: str) -> dict[str, str]:
        """What child ``child_name`` gets in its environment on top of the supervisor's:
        with cells, a cell's services their cell's key prefix, the gateway the cells."""
        if self.cells == 1:
            return {}
        if child_name == "gateway":
            return {"BLOCKQ_CELLS": self.cells_setting}
        cell = _cell_of_child(child_name, [cell for cell, *_ in self._cell_worker_ranges()])
        return {} if cell is None else {"BLOCKQ_KEY_PREFIX": self.cell_prefix(cell)}

    def vllm_wanted(self) -> VllmWanted:
        """The vLLM options as given, for sizing on a CPU node (blockq/local/vllm_sizing.py):
        the instances sharing the node are the most the fleet may reach."""
        num_sharing = self.autoscale.max_instances if self.autoscale is not None else self.instances
        return VllmWanted(num_sharing, self.vllm_block_size, self.vllm_kv_cache_bytes,
                          self.vllm_gpu_memory_utilization, self.vllm_max_model_len, self.vllm_max_num_seqs)

    def prefix_env(self) -> dict[str, str]:
        """For vLLM engines whose cache the dispatcher can follow (embedded ones, and servers
        whose KV events are read), the ``BLOCKQ_PREFIX_*`` settings every child gets:
        prompts hashed with the served model's tokenizer and the engines' block size, the
        blocks vLLM caches (:mod:`blockq.text.block_hashes`); nothing for other engines."""
        if not self.model or not (self.engine == "vllm" or self.vllm_kv_events_urls):
            return {}
        env = {"BLOCKQ_PREFIX_TOKENIZER": self.model}
        if self.vllm_block_size is not None:  # else vLLM's default, 16: the setting's default too
            env["BLOCKQ_PREFIX_BLOCK_TOKENS"] = str(self.vllm_block_size)
        return env

    def with_vllm_sizing(self, sizing: VllmSizing) -> ClusterConfig:
        """A copy with the block size and KV cache size ``sizing`` chose (None: left as is)."""
        return self.with_overrides(vllm_block_size=sizing.block_size, vllm_kv_cache_bytes=sizing.kv_cache_bytes)

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
        if self.refine_model:
            predictor += ["--http-port", str(self.predictor_http_port), "--refine-model", self.refine_model]
        dispatcher = ["dispatcher", "--policy", self.policy, "--seed", str(self.seed)]
        if self.objective:
            dispatcher += ["--objective", self.objective]
        for cell in range(self.cells):  # cell 0's services keep the one-cell names (and metrics ports)
            suffix = f"-c{cell}" if cell else ""
            children.append((f"predictor{suffix}", (*predictor, *self._metrics_argv(f"predictor{suffix}"))))
            children.append((f"dispatcher{suffix}", (*dispatcher, *self._autoscale_argv(),
                                                     *self._metrics_argv(f"dispatcher{suffix}"))))
        for process_index, (first, count, preset) in enumerate(self.worker_ranges() if workers else []):
            children.append(self.worker_child(process_index, first, count, preset))
        if self.gateway:
            gateway = ["blockq.frontdoors.gateway", "--host", self.gateway_host, "--port", str(self.gateway_port)]
            if self.gateway_allow_unauthenticated:
                gateway.append("--allow-unauthenticated")
            children.append(("gateway", tuple(gateway)))
        if self.batch_worker:
            children.append(("batch-worker", ("blockq.frontdoors.batch", "worker")))
        return children

    def worker_child(self, process_index: int, first_index: int, count: int,
                     preset: str | None = None) -> tuple[str, tuple[str, ...]]:
        """(name, argv) of the worker process ``workers-{process_index}`` serving
        instances ``first_index`` .. ``first_index + count - 1`` (of ``preset``; None: the
        cluster's)."""
        name = f"{WORKER_CHILD_PREFIX}{process_index}"
        return (name, (
            "workers", "--instance-id", self.instance_prefix, "--instances", str(count),
            "--first-index", str(first_index), *engine_argv(self, process_index, preset or self.preset),
            "--seed", str(self.seed),
            *(["--nice", str(self.engine_nice)] if self.engine_nice else []),
            *self._refine_argv(), *self._metrics_argv(name)))

    def _refine_argv(self) -> list[str]:
        if self.refine_url is None:
            return []
        return ["--refine-url", self.refine_url, "--refine-every-tokens", str(self.refine_every_tokens)]

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
        return argv


def _cell_of_child(child_name: str, cell_of_worker_process: list[int]) -> int | None:
    """The cell a child of :meth:`ClusterConfig.child_argvs` serves (None: none, or all);
    ``cell_of_worker_process``: the cell of each worker process, by its index."""
    if child_name in ("predictor", "dispatcher"):
        return 0
    for service in ("predictor-c", "dispatcher-c"):
        if child_name.startswith(service) and child_name[len(service):].isdigit():
            return int(child_name[len(service):])
    index = child_name.removeprefix(WORKER_CHILD_PREFIX)
    if child_name.startswith(WORKER_CHILD_PREFIX) and index.isdigit() and int(index) < len(cell_of_worker_process):
        return cell_of_worker_process[int(index)]
    return None


def _url_host(host: str) -> str:
    """``host`` as a URL names it: a wildcard bind is reached on loopback, IPv6 in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
