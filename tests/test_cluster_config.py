"""`blockq up` configuration: the shipped TOML parses; bad values name the setting."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from blockq.config import ConfigError, Settings
from blockq.local.cluster_config import ClusterConfig
from tests.conftest import REPO_ROOT


def test_shipped_cluster_toml_parses_and_lists_children() -> None:
    config = ClusterConfig.from_toml(REPO_ROOT / "deploy" / "cluster.toml")
    assert (config.instances, config.policy, config.num_worker_processes) == (12, "block", 2)
    names = [name for name, _ in config.child_argvs()]
    assert names == ["predictor", "dispatcher", "workers-0", "workers-1", "gateway", "batch-worker"]


def test_unknown_keys_and_bad_values_are_named(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[cluster]\ninstancez = 3\n")
    with pytest.raises(ConfigError, match="unknown keys in \\[cluster\\]: instancez"):
        ClusterConfig.from_toml(path)
    with pytest.raises(ConfigError, match="time_scale: must be in"):
        ClusterConfig(time_scale=0)
    with pytest.raises(ConfigError, match="instances: must be between 1 and 1024"):
        ClusterConfig().with_overrides(instances=0)


def worker_argvs(config: ClusterConfig) -> list[tuple[str, ...]]:
    return [argv for name, argv in config.child_argvs() if name.startswith("workers-")]


def metrics_argv(port: int) -> tuple[str, ...]:
    return ("--metrics-port", str(port), "--metrics-host", "127.0.0.1")


def test_emulated_worker_argv_is_unchanged() -> None:
    config = ClusterConfig(instances=8, instances_per_process=6, preset="llama2-7b-h100", time_scale=2.0, seed=3)
    assert worker_argvs(config) == [
        ("workers", "--instance-id", "inst", "--instances", "6", "--first-index", "0", "--preset", "llama2-7b-h100",
         "--time-scale", "2.0", "--noise", "0.05", "--seed", "3", *metrics_argv(9402)),
        ("workers", "--instance-id", "inst", "--instances", "2", "--first-index", "6", "--preset", "llama2-7b-h100",
         "--time-scale", "2.0", "--noise", "0.05", "--seed", "3", *metrics_argv(9403)),
    ]


def test_vllm_from_toml_runs_one_engine_per_worker_process(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\ninstances = 3\ninstances_per_process = 6\nengine = "vllm"\n'
                    'model = "/models/llama"\nvllm_block_size = 16\nvllm_kv_cache_bytes = 4000000000\n'
                    'vllm_gpu_memory_utilization = 0.3\nvllm_max_model_len = 2048\ntime_scale = 2.0\n')
    config = ClusterConfig.from_toml(path)
    assert config.num_worker_processes == 3
    vllm_options = ("--engine", "vllm", "--model", "/models/llama", "--block-size", "16",
                    "--kv-cache-bytes", "4000000000", "--gpu-memory-utilization", "0.3", "--max-model-len", "2048")
    assert worker_argvs(config) == [
        ("workers", "--instance-id", "inst", "--instances", "1", "--first-index", str(i), *vllm_options,
         "--seed", "0", *metrics_argv(9402 + i)) for i in range(3)]
    # The emulated engine's options do not reach a vLLM worker.
    assert not {"--preset", "--time-scale", "--noise"} & {arg for argv in worker_argvs(config) for arg in argv}


def test_vllm_from_overrides_passes_only_the_options_set() -> None:
    config = ClusterConfig().with_overrides(engine="vllm", model="m", vllm_max_model_len=4096,
                                            vllm_block_size=None)
    assert worker_argvs(config) == [
        ("workers", "--instance-id", "inst", "--instances", "1", "--first-index", str(i), "--engine", "vllm",
         "--model", "m", "--max-model-len", "4096", "--seed", "0", *metrics_argv(9402 + i)) for i in range(2)]
    # Back to the emulated engine: its processes serve instances_per_process again.
    emulated = config.with_overrides(engine="emulated")
    assert emulated.num_worker_processes == 1 and "--preset" in worker_argvs(emulated)[0]


def test_up_flags_map_to_the_vllm_fields() -> None:
    from blockq.cli.main import build_parser
    from blockq.local.up import _cluster_config

    args = build_parser().parse_args(["up", "--engine", "vllm", "--model", "/m", "--block-size", "32",
                                      "--kv-cache-bytes", "1000", "--gpu-memory-utilization", "0.5",
                                      "--max-model-len", "1024"])
    config = _cluster_config(args)
    assert (config.engine, config.model, config.vllm_block_size, config.vllm_kv_cache_bytes,
            config.vllm_gpu_memory_utilization, config.vllm_max_model_len) == ("vllm", "/m", 32, 1000, 0.5, 1024)
    assert _cluster_config(build_parser().parse_args(["up"])).engine == "emulated"


@pytest.mark.parametrize(("values", "field"), [
    ({"engine": "vllm"}, "model"),
    ({"engine": "vllm", "model": ""}, "model"),
    ({"engine": "tensorrt"}, "engine"),
    ({"engine": "vllm", "model": "m", "vllm_block_size": 0}, "vllm_block_size"),
    ({"engine": "vllm", "model": "m", "vllm_kv_cache_bytes": -1}, "vllm_kv_cache_bytes"),
    ({"engine": "vllm", "model": "m", "vllm_max_model_len": 1.5}, "vllm_max_model_len"),
    ({"engine": "vllm", "model": "m", "vllm_gpu_memory_utilization": 0.0}, "vllm_gpu_memory_utilization"),
    ({"engine": "vllm", "model": "m", "vllm_gpu_memory_utilization": 1.2}, "vllm_gpu_memory_utilization"),
])
def test_bad_engine_settings_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):
        ClusterConfig(**values)  # type: ignore[arg-type]


def test_vllm_without_model_in_toml_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\nengine = "vllm"\n')
    with pytest.raises(ConfigError, match="^model: required with engine vllm"):
        ClusterConfig.from_toml(path)


def test_env_settings_are_validated() -> None:
    assert Settings.from_env({"BLOCKQ_REDIS_URL": "rediss://u:p@h:6380/0"}).redis_url == "rediss://u:p@h:6380/0"
    with pytest.raises(ConfigError, match="redis_url: scheme"):
        Settings.from_env({"BLOCKQ_REDIS_URL": "http://x"})
    with pytest.raises(ConfigError, match="BLOCKQ_MAX_BACKLOG: must be an integer"):
        Settings.from_env({"BLOCKQ_MAX_BACKLOG": "lots"})


def test_autoscale_runs_one_instance_per_process_and_passes_the_rules_on(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\ninstances = 2\ninstances_per_process = 6\n'
                    '[cluster.autoscale]\nscaler = "reactive"\nmin_instances = 1\nmax_instances = 5\ncycle_s = 10\n')
    config = ClusterConfig.from_toml(path)
    assert config.autoscale is not None and config.autoscale.scaler == "reactive"
    assert [argv[4:7] for argv in worker_argvs(config)] == [("1", "--first-index", "0"), ("1", "--first-index", "1")]
    (dispatcher,) = [argv for name, argv in config.child_argvs() if name == "dispatcher"]
    assert dispatcher[dispatcher.index("--autoscale") + 1] == "reactive"
    assert dispatcher[dispatcher.index("--max-instances") + 1] == "5"
    assert dispatcher[dispatcher.index("--cycle-s") + 1] == "10"
    assert [name for name, _ in config.child_argvs(workers=False)] == ["predictor", "dispatcher"]
    assert config.worker_child(7, 7, 1)[0] == "workers-7" and config.instance_id(7) == "inst-7"


def test_up_autoscale_flags_start_at_the_minimum_and_name_bad_values(tmp_path: Path) -> None:
    from blockq.cli.main import build_parser
    from blockq.local.up import _cluster_config

    def config_of(*argv: str) -> ClusterConfig:
        return _cluster_config(build_parser().parse_args(["up", *argv]))

    config = config_of("--autoscale", "predictive", "--min-instances", "2", "--max-instances", "6",
                       "--cooldown-s", "30", "--reversal-hold-s", "60", "--scale-command", "-x {n}")
    assert config.instances == 2 and config.autoscale is not None
    assert (config.autoscale.cooldown_s, config.autoscale.scale_command) == (30.0, "-x {n}")
    (dispatcher,) = [argv for name, argv in config.child_argvs() if name == "dispatcher"]
    assert "--scale-command=-x {n}" in dispatcher
    assert config_of("--autoscale", "predictive", "--instances", "3").instances == 3
    assert config_of().autoscale is None
    with pytest.raises(ConfigError, match="min_instances: needs --autoscale"):
        config_of("--min-instances", "2")
    with pytest.raises(ConfigError, match="instances: must be between min_instances"):
        config_of("--autoscale", "predictive", "--instances", "9", "--max-instances", "4")
    with pytest.raises(ConfigError, match="reversal_hold_s"):
        config_of("--autoscale", "reactive", "--cooldown-s", "700")
    path = tmp_path / "c.toml"
    path.write_text("[cluster.autoscale]\nmin_instance = 1\n")
    with pytest.raises(ConfigError, match=r"unknown keys in \[cluster.autoscale\]: min_instance"):
        ClusterConfig.from_toml(path)


def test_a_refinement_model_serves_refine_on_the_predictor_and_points_the_workers_at_it() -> None:
    config = ClusterConfig(instances=3, instances_per_process=2, refine_model="models/refine",
                           predictor_http_port=8123, refine_every_tokens=32)
    argvs = dict(config.child_argvs())
    predictor = argvs["predictor"]
    assert predictor[predictor.index("--http-port") + 1] == "8123"
    assert predictor[predictor.index("--refine-model") + 1] == "models/refine"
    for name in ("workers-0", "workers-1"):
        worker = argvs[name]
        assert worker[worker.index("--refine-url") + 1] == "http://127.0.0.1:8123"
        assert worker[worker.index("--refine-every-tokens") + 1] == "32"
    assert "--refine-url" not in ClusterConfig().worker_child(0, 0, 1)[1]
    with pytest.raises(ConfigError, match="predictor_http_port"):
        ClusterConfig(refine_model="m", gateway=True, gateway_port=8100)
    with pytest.raises(ConfigError, match="refine_every_tokens"):
        ClusterConfig(refine_every_tokens=0)


def test_pinned_vllm_instances_each_get_a_core_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    config = ClusterConfig().with_overrides(engine="vllm", model="m", instances=3, vllm_pin_cores=True)
    cores = [argv[argv.index("--cpu-core") + 1] for argv in worker_argvs(config)]
    assert cores == ["0", "1", "0"]  # instance K on core K modulo the node's cores
    assert all("--cpu-core" not in argv for argv in worker_argvs(config.with_overrides(vllm_pin_cores=False)))
    # a measured profile reaches the vLLM workers: the latency model they publish
    profiled = worker_argvs(config.with_overrides(preset="/profiles/tiny.json"))[0]
    assert profiled[profiled.index("--profile") + 1] == "/profiles/tiny.json"
    niced = worker_argvs(config.with_overrides(engine_nice=10))[0]
    assert niced[niced.index("--nice") + 1] == "10" and "--nice" not in worker_argvs(config)[0]
    with pytest.raises(ConfigError, match="engine_nice"):
        config.with_overrides(engine_nice=20)


def test_bench_passes_vllm_options_to_up_and_draws_a_sample_per_seed() -> None:
    from blockq.cli.main import build_parser
    from loadgen.benches.live import load_requests
    from loadgen.cli import config_from_args

    args = build_parser().parse_args([
        "bench", "--engine", "vllm", "--model", "/models/tiny", "--max-num-seqs", "16", "--block-size", "32",
        "--max-model-len", "2048", "--enforce-eager", "--pin-cores", "--engine-nice", "10", "--seeds", "1,2",
        "--requests", "20"])
    config = config_from_args(args)
    assert config.engine == "vllm" and config.all_seeds == (1, 2) and config.max_model_len == 2048
    assert config.engine_flags == ("--model", "/models/tiny", "--block-size", "32", "--max-model-len", "2048",
                                   "--max-num-seqs", "16", "--enforce-eager", "--pin-cores", "--engine-nice", "10")
    first, second = (load_requests(replace(config, seed=seed)) for seed in (1, 2))
    assert len(first) == len(second) == 20 and [r.prompt for r in first] != [r.prompt for r in second]
    with pytest.raises(SystemExit, match="--model"):
        config_from_args(build_parser().parse_args(["bench", "--engine", "vllm"]))


def test_two_cells_get_their_own_services_instances_and_prefixes() -> None:
    config = ClusterConfig(instances=4, instances_per_process=1, cells=2, gateway=True)
    children = dict(config.child_argvs())
    assert list(children) == ["predictor", "dispatcher", "predictor-c1", "dispatcher-c1", "workers-0", "workers-1",
                              "workers-2", "workers-3", "gateway"]
    # Instance ids stay unique across cells: cell 1 serves inst-2 and inst-3.
    firsts = [argv[argv.index("--first-index") + 1] for name, argv in children.items() if name.startswith("workers-")]
    assert firsts == ["0", "1", "2", "3"]
    prefixes = {name: config.child_env(name).get("BLOCKQ_KEY_PREFIX") for name in children}
    assert prefixes == {"predictor": "{cell0}:", "dispatcher": "{cell0}:", "predictor-c1": "{cell1}:",
                        "dispatcher-c1": "{cell1}:", "workers-0": "{cell0}:", "workers-1": "{cell0}:",
                        "workers-2": "{cell1}:", "workers-3": "{cell1}:", "gateway": None}
    assert config.child_env("gateway") == {"BLOCKQ_CELLS": "{cell0}: {cell1}:"}
    assert ClusterConfig(instances=4).child_env("dispatcher") == {}  # one cell: nothing changes
    with pytest.raises(ConfigError, match="cells: must be between 1 and 8 and divide instances"):
        ClusterConfig(instances=3, cells=2)


def test_vllm_http_servers_kv_events_reach_their_workers_and_the_prefix_scheme() -> None:
    urls = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    events = ("tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557")
    config = ClusterConfig().with_overrides(engine="vllm-http", instances=2, vllm_urls=urls, vllm_kv_events_urls=events,
                                            model="/models/llama", vllm_block_size=32)
    for process_index in range(2):
        argv = config.worker_child(process_index, process_index, 1)[1]
        assert argv[argv.index("--url") + 1] == urls[process_index]
        assert argv[argv.index("--kv-events-url") + 1] == events[process_index]
        assert argv[argv.index("--model") + 1] == "/models/llama"
    assert config.prefix_env() == {"BLOCKQ_PREFIX_TOKENIZER": "/models/llama", "BLOCKQ_PREFIX_BLOCK_TOKENS": "32"}
    without = ClusterConfig().with_overrides(engine="vllm-http", instances=2, vllm_urls=urls)
    assert "--kv-events-url" not in without.worker_child(0, 0, 1)[1] and without.prefix_env() == {}
    with pytest.raises(ConfigError, match="vllm_kv_events_urls: .*one a server"):
        ClusterConfig().with_overrides(engine="vllm-http", instances=2, vllm_urls=urls, vllm_kv_events_urls=events[:1],
                                       model="/models/llama")
    with pytest.raises(ConfigError, match="model: required with vllm_kv_events_urls"):
        ClusterConfig().with_overrides(engine="vllm-http", instances=2, vllm_urls=urls, vllm_kv_events_urls=events)
    with pytest.raises(ConfigError, match="vllm_kv_events_urls: with engine vllm-http only"):
        ClusterConfig().with_overrides(vllm_kv_events_urls=events[:1], model="/models/llama")
