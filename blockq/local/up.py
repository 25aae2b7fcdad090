"""``blockq up`` and ``blockq down``: a local cluster under a supervisor (embedded Redis
unless ``--redis``), its configuration from a TOML file and flags, and the wait until it
is ready. ``up --detach`` reports ready, or fails and leaves nothing running when a child
cannot start (docs/commands.md, "Stopping a cluster")."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockq.config import (
    LIVE_SCALERS,
    AutoscaleOptions,
    ConfigError,
    Settings,
    add_refine_arguments,
    add_scaling_options,
)
from blockq.engine_model.fleet_spec import parse_fleet
from blockq.local.cluster_config import (
    WILL_NOT_START_EXIT_CODE,
    WILL_NOT_START_MARKER,
    ClusterConfig,
)
from blockq.local.state import (
    CLUSTER_ENV,
    EXEC_GRACE_S,
    ClusterState,
    ProcessIdentity,
    cluster_marker,
    read_supervisor,
    record_supervisor,
)
from blockq.runtime.service_runner import add_common_arguments, settings_from_args

if TYPE_CHECKING:  # the supervisor is imported only by the command that runs one
    from blockq.local.supervisor import ChildSpec, WorkerScaling


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


# `blockq up`'s vLLM options: each sets the cluster config's field vllm_<name>.
VLLM_UP_OPTIONS = (
    ("--block-size", int, "vLLM KV block size in tokens (CPU: a multiple of 32)"),
    ("--kv-cache-bytes", int, "vLLM KV cache size per instance, in bytes"),
    ("--gpu-memory-utilization", float, "fraction of GPU (CPU: node) memory each vLLM instance may use"),
    ("--max-model-len", int, "vLLM max_model_len"),
    ("--max-num-seqs", int, "vLLM max_num_seqs"),
    ("--lora-modules", str, "LoRA adapters every vLLM instance serves, NAME=PATH,... (vLLM --enable-lora)"),
    ("--max-loras", int, "vLLM max_loras: adapters resident and in one batch at most (vllm-http: the "
                         "servers', until their /metrics say)"),
)

# A child that died this many times in a row before the cluster was ready will not come up
# by itself (a taken port, a bad flag): `up` stops the cluster and says why.
MAX_START_FAILURES = 3

# How long `up --detach` waits for a cluster that is still starting. A vLLM engine loads and
# compiles its model first (over 2 minutes for two engines on 2 shared cores here); one that
# cannot start fails at once (WILL_NOT_START_EXIT_CODE), so the long wait is only for progress.
READY_TIMEOUT_S = 120.0
VLLM_READY_TIMEOUT_S = 600.0

# `blockq up`'s autoscaling options: each sets the AutoscaleOptions field of its name.
AUTOSCALE_UP_OPTIONS = (
    ("--scale-command", str, "shell command run by the dispatcher when the target changes, {n} = the size"),
)


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local cluster (embedded Redis unless --redis)")
    add_common_arguments(p)
    p.add_argument("--config", type=Path, default=None, help="cluster TOML file ([cluster] table)")
    p.add_argument("--instances", type=int, default=None, help="number of engine instances (default 2)")
    p.add_argument("--instances-per-process", type=int, default=None, help="instances per worker process (default 6)")
    p.add_argument("--policy", default=None, help="placement policy (default round_robin)")
    p.add_argument("--objective", default=None, help="objective of the block policy: e2e | ttft | max_latency")
    p.add_argument("--preset", default=None, help="engine preset (default llama2-7b-a30)")
    p.add_argument("--fleet", default=None, metavar="COUNT:PRESET[,...]",
                   help="a mixed fleet of emulated engines, e.g. 6:llama2-7b-a30,2:llama2-7b-h100-tp2 "
                        "(replaces --instances and --preset; no autoscale; with --cells, split interleaved)")
    p.add_argument("--time-scale", type=float, default=None, help="wall seconds per model second (default 1)")
    p.add_argument("--engine", choices=["emulated", "vllm", "vllm-http"], default=None,
                   help="engine of every instance (default emulated); vllm-http: a worker per running vLLM "
                        "server of --url")
    p.add_argument("--url", dest="vllm_urls", type=_urls, default=None, metavar="URL[,URL...]",
                   help="--engine vllm-http: the vLLM servers (http://host:port), one instance each")
    p.add_argument("--kv-events-url", dest="vllm_kv_events_urls", type=_urls, default=None, metavar="URL[,URL...]",
                   help="--engine vllm-http: where each server publishes its KV cache events (tcp://host:port, "
                        "one a server; with --model DIR, prefix hits are predicted on them)")
    p.add_argument("--model", default=None, help="model path or name (required with --engine vllm)")
    for option, kind, text in VLLM_UP_OPTIONS:
        p.add_argument(option, dest="vllm_" + option[2:].replace("-", "_"), type=kind, default=None, help=text)
    p.add_argument("--enforce-eager", dest="vllm_enforce_eager", action="store_true", default=None,
                   help="vLLM without graph capture or compilation (a fast start-up)")
    p.add_argument("--engine-nice", type=int, default=None,
                   help="run the workers and their engines this many steps nicer (a node shared with the "
                        "dispatcher, Redis and clients: the engines yield to them)")
    p.add_argument("--pin-cores", dest="vllm_pin_cores", action="store_true", default=None,
                   help="vLLM on CPU: instance K runs its kernels on core K modulo the node's cores "
                        "(instances do not share cores)")
    p.add_argument("--prefix-caching", action="store_true", default=None,
                   help="every instance reuses cached prompt prefixes (emulated: counted hits; vLLM: "
                        "enable_prefix_caching=True)")
    p.add_argument("--predictor", dest="predictor_backend", default=None, help="predictor backend (default heuristic)")
    p.add_argument("--predictor-model", default=None, help="trained predictor directory")
    add_refine_arguments(p, defaults=False)
    p.add_argument("--cells", type=int, default=None,
                   help="split the instances evenly (a --fleet interleaved) into this many cells, each with its own "
                        "predictor, dispatcher and key prefix {cellK}: (default 1); the gateway routes between them "
                        "(docs/architecture.md)")
    p.add_argument("--gateway", action="store_true", default=None, help="also start the HTTP gateway")
    p.add_argument("--gateway-port", type=int, default=None)
    p.add_argument("--batch-worker", action="store_true", default=None, help="also start the batch (rq) worker")
    p.add_argument("--metrics-base-port", type=int, default=None,
                   help="Prometheus metrics: the dispatcher on this port, the predictor on the next, worker "
                        "process K on PORT+2+K (default 9400; 0: none); the gateway serves them on its own port")
    p.add_argument("--metrics-host", default=None, help="address the metrics servers bind (default 127.0.0.1)")
    p.add_argument("--redis-maxmemory", default=None,
                   help="memory limit of the embedded Redis, e.g. 1gb (default), 512mb; writes fail when full")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--autoscale", choices=LIVE_SCALERS, default=None,
                   help="the dispatcher sizes the fleet with this scaler and the supervisor follows it "
                        "(one instance per worker process; --instances, default --min-instances, to start)")
    add_scaling_options(p, dest_prefix="autoscale_", with_defaults=False)
    for option, kind, text in AUTOSCALE_UP_OPTIONS:
        p.add_argument(option, dest="autoscale_" + option[2:].replace("-", "_"), type=kind, default=None, help=text)
    p.add_argument("--detach", action="store_true", help="return once the cluster is ready")
    p.add_argument("--ready-timeout-s", type=float, default=None,
                   help=f"--detach: seconds to wait until every instance is live (default {READY_TIMEOUT_S:.0f}; "
                        f"--engine vllm: {VLLM_READY_TIMEOUT_S:.0f})")
    p.add_argument("--json", action="store_true", help="print the ready report as JSON")
    p.set_defaults(handler=cmd_up)


def _urls(text: str) -> tuple[str, ...]:
    return tuple(url.strip() for url in text.split(",") if url.strip())


def _cluster_config(args: argparse.Namespace) -> ClusterConfig:
    base = ClusterConfig.from_toml(args.config) if args.config else ClusterConfig()
    autoscale = _autoscale_options(args, base.autoscale)
    instances = args.instances
    if instances is None and args.vllm_urls:
        instances = len(args.vllm_urls)  # one instance a server
    fleet = args.fleet or base.fleet
    if instances is None and fleet:
        try:
            instances = parse_fleet(fleet).num_instances
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if autoscale is not None and instances is None and "instances" not in (
            ClusterConfig.toml_section(args.config) if args.config else {}):
        instances = autoscale.min_instances  # the fleet starts small and grows on demand
    return base.with_overrides(
        instances=instances, autoscale=autoscale, instances_per_process=args.instances_per_process, policy=args.policy,
        objective=args.objective, preset=args.preset, time_scale=args.time_scale, fleet=args.fleet,
        predictor_backend=args.predictor_backend, predictor_model=args.predictor_model,
        gateway=args.gateway, gateway_port=args.gateway_port, batch_worker=args.batch_worker, seed=args.seed,
        redis_maxmemory=args.redis_maxmemory, engine=args.engine, model=args.model,
        metrics_base_port=args.metrics_base_port, metrics_host=args.metrics_host,
        refine_model=args.refine_model, refine_every_tokens=args.refine_every_tokens,
        prefix_caching=args.prefix_caching, engine_nice=args.engine_nice, cells=args.cells,
        **{name: value for name, value in vars(args).items() if name.startswith("vllm_")})


def _autoscale_options(args: argparse.Namespace, base: AutoscaleOptions | None) -> AutoscaleOptions | None:
    """The TOML's ``[cluster.autoscale]`` overridden by flags; None when neither turns it on
    (a bound or timing flag alone is refused: it would be silently ignored)."""
    given = {name[len("autoscale_"):]: value for name, value in vars(args).items()
             if name.startswith("autoscale_") and value is not None}
    if args.autoscale is not None:
        given["scaler"] = args.autoscale
    elif base is None:
        if given:
            raise ConfigError(f"{next(iter(given))}: needs --autoscale (or a [cluster.autoscale] table)")
        return None
    return replace(base or AutoscaleOptions(), **given)


def _scaling(config: ClusterConfig, settings: Settings) -> WorkerScaling | None:
    """What the supervisor follows under autoscale (None without it)."""
    from blockq.local.supervisor import WorkerScaling

    if config.autoscale is None:
        return None
    return WorkerScaling(worker_spec=lambda index: child_spec(config, *config.worker_child(index, index, 1)),
                         instance_id=config.instance_id, initial=config.instances,
                         min_instances=config.autoscale.min_instances, max_instances=config.autoscale.max_instances,
                         desired_key=settings.keys.autoscaler_desired, drain_key=settings.keys.autoscaler_drain)


def child_spec(config: ClusterConfig, name: str, argv: tuple[str, ...]) -> ChildSpec:
    """The supervisor's spec of child ``name``, with where it serves its metrics."""
    from blockq.local.supervisor import ChildSpec

    return ChildSpec(name, argv, metrics_url=config.metrics_url(name), env=tuple(config.child_env(name).items()))


def cmd_up(args: argparse.Namespace) -> int:
    from blockq.local.supervisor import Supervisor

    settings = settings_from_args(args, require_redis=False)
    config = size_vllm(_cluster_config(args))
    running = _running_supervisor(settings.state_dir)
    if running is not None:
        raise ConfigError(f"state_dir: a cluster is already running from {settings.state_dir} "
                          f"(supervisor pid {running}); run `blockq down` first")
    if args.detach:
        return _up_detached(args, settings.state_dir, config, settings.redis_url)
    from blockq.runtime.logs import configure_logging

    configure_logging(settings.log_level, "supervisor")
    # Children inherit it; a value the user set wins.
    os.environ.update({name: value for name, value in config.prefix_env().items() if name not in os.environ})
    scaling = _scaling(config, settings)
    specs = [child_spec(config, name, argv) for name, argv in config.child_argvs(workers=scaling is None)]
    gateway_url = f"http://{config.gateway_host}:{config.gateway_port}" if config.gateway else None
    return Supervisor(settings.state_dir, specs, redis_url=settings.redis_url, num_instances=config.instances,
                      gateway_url=gateway_url, redis_maxmemory=config.redis_maxmemory, scaling=scaling).run()


def size_vllm(config: ClusterConfig) -> ClusterConfig:
    """``config`` with the vLLM block size and KV cache size chosen on a CPU node where not
    given, from the node's free memory and the model's files (docs/engines.md, "Sizing
    vLLM on a CPU node"); ConfigError naming the option when it cannot start. Anything
    else (the emulated engine, vLLM's GPU build) is left as given."""
    from blockq.local.vllm_sizing import (
        measure_node,
        read_model_shape,
        size_cpu_instances,
        vllm_runs_on_cpu,
    )

    if config.engine != "vllm" or not vllm_runs_on_cpu():
        return config
    sizing = size_cpu_instances(config.vllm_wanted(), measure_node(), read_model_shape(str(config.model)))
    sys.stderr.write(f"blockq up: vLLM on CPU: {sizing.reason}\n")
    return config.with_vllm_sizing(sizing)


def _sized_argv(config: ClusterConfig) -> list[str]:
    """The sizes chosen, as flags for the detached supervisor: it runs with what this
    process measured and printed, not a second measure of a node whose free memory moved."""
    argv: list[str] = []
    if config.engine == "vllm":
        for option, value in (("--block-size", config.vllm_block_size),
                              ("--kv-cache-bytes", config.vllm_kv_cache_bytes)):
            argv += [option, str(value)] if value is not None else []
    return argv


def _running_supervisor(state_dir: Path) -> int | None:
    """The pid of the live supervisor of ``state_dir`` other than this process (a detached
    supervisor runs this command too, and ``up`` has recorded it already); None if none."""
    state = ClusterState.read(state_dir)
    if state is not None and state.supervisor_pid != os.getpid() and state.supervisor_is_alive():
        return state.supervisor_pid
    supervisor = read_supervisor(state_dir)
    if supervisor is not None and supervisor.pid != os.getpid() and supervisor.is_alive():
        return supervisor.pid
    return None


def _argv_without_secrets(argv: list[str]) -> list[str]:
    """``argv`` less --detach, --json and --redis URL (a URL may hold a password, and any
    user can read a process's argv: the URL travels in the environment instead)."""
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--redis":
            skip_next = True
        elif arg not in ("--detach", "--json") and not arg.startswith("--redis="):
            out.append(arg)
    return out


def _up_detached(args: argparse.Namespace, state_dir: Path, config: ClusterConfig,
                 redis_url: str | None) -> int:
    """Start the supervisor in the background and wait for every instance to be live."""
    started_s = time.monotonic()
    argv = _argv_without_secrets(sys.argv[1:]) + _sized_argv(config)
    env = dict(os.environ, **{CLUSTER_ENV: cluster_marker(state_dir)})
    if redis_url:
        env["BLOCKQ_REDIS_URL"] = redis_url
    os.umask(0o077)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state_dir / "logs").mkdir(exist_ok=True)
    with open(state_dir / "logs" / "supervisor.log", "ab") as log_file:
        supervisor = subprocess.Popen([sys.executable, "-m", "blockq.cli", *argv], stdout=log_file,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                      env=env)
    # Recorded at once (the supervisor records itself too, a second later): a `down` from
    # now on finds it, though it has not written cluster.json yet.
    identity = ProcessIdentity.try_of(supervisor.pid, exec_grace_s=EXEC_GRACE_S)
    if identity is not None:
        record_supervisor(state_dir, identity)
    timeout_s = args.ready_timeout_s if args.ready_timeout_s is not None else (
        VLLM_READY_TIMEOUT_S if config.engine == "vllm" else READY_TIMEOUT_S)
    report = wait_until_ready(args, state_dir, config.instances, timeout_s, supervisor,
                              cell_prefixes=tuple(config.cell_prefix(c) for c in range(config.cells))
                              if config.cells > 1 else ())
    report["ready_s"] = round(time.monotonic() - started_s, 3)
    if args.json:
        print_json(report)
    else:
        sys.stdout.write(f"blockq is up: {report['num_live_instances']} instances live, redis {report['redis_url']}, "
                         f"ready in {report['ready_s']:.1f} s (state in {state_dir})\n")
    return 0


def wait_until_ready(args: argparse.Namespace, state_dir: Path, num_instances: int, timeout_s: float,
                     supervisor: subprocess.Popen[bytes] | None = None, *,
                     cell_prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The status of the cluster once ``num_instances`` are live and a dispatcher leads
    (with ``cell_prefixes``: in all, and one in every cell).
    SystemExit naming the cause when ``supervisor`` exits first, when a child keeps dying
    as it starts (the cluster is stopped then), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if supervisor is not None and supervisor.poll() is not None:
            raise SystemExit(f"blockq up: the supervisor exited (code {supervisor.returncode}) before the cluster "
                             f"was ready; see {state_dir / 'logs'}")
        state = ClusterState.read(state_dir)
        if state is not None:
            failure = _start_failure(state_dir, state)
            if failure is not None:
                _give_up(state_dir, failure)
            status = _try_ready_status(args, state, num_instances, cell_prefixes)
            if status is not None:
                return status
        time.sleep(0.1)
    raise SystemExit(f"blockq up: cluster not ready within {timeout_s:.0f} s; see {state_dir / 'logs'} "
                     f"(it is still starting: `blockq down` stops it)")


def _try_ready_status(args: argparse.Namespace, state: ClusterState, num_instances: int,
                      cell_prefixes: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The status when the cluster is ready; None while it is not (Redis not answering yet
    included). With cells: the first cell's status, its ``num_live_instances`` counting
    every cell's, and ``cells`` (each cell's prefix, live instances and leader)."""
    import redis

    from blockq.local.status import add_cluster_urls, collect_status
    from blockq.wire.streams import connect

    settings = settings_from_args(args)
    client = connect(state.redis_url)
    try:
        statuses = [collect_status(client, dataclasses.replace(settings, key_prefix=prefix))
                    for prefix in cell_prefixes] or [collect_status(client, settings)]
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    status = statuses[0]
    if cell_prefixes:
        status["cells"] = [{"prefix": s["prefix"], "num_live_instances": s["num_live_instances"],
                            "dispatcher_leader": s["dispatcher_leader"]} for s in statuses]
        status["num_live_instances"] = sum(s["num_live_instances"] for s in statuses)
    if status["num_live_instances"] >= num_instances and all(s["dispatcher_leader"] for s in statuses):
        return add_cluster_urls(status, state)
    return None


def _start_failure(state_dir: Path, state: ClusterState) -> str | None:
    """Why a child of a starting cluster will not come up (its last words), or None: at
    once when it exited saying so (WILL_NOT_START_EXIT_CODE), else after
    MAX_START_FAILURES deaths in a row."""
    for name, failure in sorted(state.child_failures.items()):
        if failure.get("returncode") == WILL_NOT_START_EXIT_CODE:
            return _will_not_start(name, state_dir / "logs" / f"{name}.log")
        if failure.get("num_restarts", 0) >= MAX_START_FAILURES:
            return (f"{name} exited {failure['num_restarts']} times in a row while starting "
                    f"(exit code {failure.get('returncode')}): {_last_line(state_dir / 'logs' / f'{name}.log')}")
    return None


def _will_not_start(name: str, log_path: Path) -> str:
    """The option to change and vLLM's reason where its log says (vLLM's engine-core
    process logs the cause, the worker only that it died), else the worker's own line."""
    from blockq.local.vllm_sizing import explain_vllm_refusal

    lines = _tail_lines(log_path, num_bytes=65536)
    marks = [index for index, line in enumerate(lines) if WILL_NOT_START_MARKER in line]
    if not marks:
        return f"{name} {WILL_NOT_START_MARKER} {_last_line(log_path)}"
    # This start's lines only: the log is appended to, and an earlier start may have
    # failed otherwise.
    this_start = lines[(marks[-2] + 1 if len(marks) > 1 else 0):marks[-1] + 1]
    return f"{name} {WILL_NOT_START_MARKER} {explain_vllm_refusal(this_start) or lines[marks[-1]][:800]}"


def _tail_lines(path: Path, num_bytes: int = 8192) -> list[str]:
    """The non-blank lines of the last ``num_bytes`` of ``path`` (none if unreadable)."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - num_bytes))
            return [line for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return []


def _last_line(path: Path, max_chars: int = 400) -> str:
    if not path.exists():
        return "(no log)"
    lines = _tail_lines(path)
    return lines[-1][:max_chars] if lines else "(empty log)"


def _give_up(state_dir: Path, failure: str) -> None:
    """Stop the cluster that cannot start, and exit saying why."""
    from blockq.local.teardown import stop_cluster

    report = stop_cluster(state_dir, timeout_s=30.0)
    left = (f"; {len(report.survivors)} of its processes could not be stopped: `blockq down`"
            if report.survivors else "; stopped the cluster")
    raise SystemExit(f"blockq up: {failure}{left} (logs in {state_dir / 'logs'})")
