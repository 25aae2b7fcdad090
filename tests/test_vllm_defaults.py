"""`blockq up --engine vllm` with no tuning flags (issue #38, "defaults that start"): on a
CPU node each instance's KV cache is cut from the free memory shared among the instances;
a configuration that cannot start fails at once naming the option to change.

The sizing rule and the checks are pure and run in the default suite; the tests marked
``vllm`` start real vLLM engines (``BLOCKQ_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest
-q -m vllm -s tests/test_vllm_defaults.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from blockq.config import ConfigError
from blockq.local.cluster_config import WILL_NOT_START_EXIT_CODE, ClusterConfig
from blockq.local.state import ClusterState
from blockq.local.vllm_sizing import (
    CPU_DEFAULT_BLOCK_SIZE,
    INSTANCE_RUNTIME_BYTES,
    GiB,
    MiB,
    ModelShape,
    NodeMemory,
    VllmWanted,
    explain_vllm_refusal,
    model_shape_from_config,
    read_model_shape,
    size_cpu_instances,
)
from tests.conftest import import_or_skip, run_blockq, write_tiny_model

# The tiny model `blockq tiny-model` writes: 2 layers x 2 KV heads x 64, bf16.
TINY = ModelShape(weights_bytes=10 * MiB, kv_bytes_per_token=1024, max_position_embeddings=4096)
# Llama-2-7B: 32 layers x 32 KV heads x 128, bf16, 13.5 GB of weights.
LLAMA_7B = ModelShape(weights_bytes=13_476_839_424, kv_bytes_per_token=524_288, max_position_embeddings=4096)
NODE = NodeMemory(available_bytes=22 * GiB, total_bytes=23 * GiB)


def test_no_flags_share_the_free_memory_capped_at_what_the_scheduler_can_fill() -> None:
    sizing = size_cpu_instances(VllmWanted(num_instances=2), NODE, TINY)
    # 48 sequences of 4,096 tokens at 1 KiB a token: 192 MiB, far under each share.
    assert (sizing.block_size, sizing.kv_cache_bytes) == (CPU_DEFAULT_BLOCK_SIZE, 48 * 4096 * 1024)
    big_node = NodeMemory(available_bytes=120 * GiB, total_bytes=128 * GiB)
    sizing = size_cpu_instances(VllmWanted(num_instances=4, max_num_seqs=256), big_node, LLAMA_7B)
    share = (120 * GiB - 12 * GiB) // 4
    assert sizing.kv_cache_bytes == share - LLAMA_7B.weights_bytes - INSTANCE_RUNTIME_BYTES
    assert sizing.kv_cache_bytes * 4 + 4 * (LLAMA_7B.weights_bytes + INSTANCE_RUNTIME_BYTES) < big_node.available_bytes


def test_explicit_options_win() -> None:
    sizing = size_cpu_instances(VllmWanted(2, block_size=32, kv_cache_bytes=2 * MiB, max_model_len=1024), NODE, TINY)
    assert (sizing.block_size, sizing.kv_cache_bytes) == (None, None)  # the flags given go through as they are
    env_node = NodeMemory(NODE.available_bytes, NODE.total_bytes, kv_cache_env_gib=1)
    assert size_cpu_instances(VllmWanted(2), env_node, TINY).kv_cache_bytes is None
    assert size_cpu_instances(VllmWanted(2, gpu_memory_utilization=0.3), NODE, TINY).kv_cache_bytes is None


@pytest.mark.parametrize(("wanted", "node", "model", "option"), [
    (VllmWanted(2), NODE, LLAMA_7B, "--instances"),  # two 7B instances on 22 GiB
    (VllmWanted(2, block_size=16), NODE, TINY, "--block-size"),
    (VllmWanted(2, max_model_len=8192), NODE, TINY, "--max-model-len"),
    (VllmWanted(2, kv_cache_bytes=1000), NODE, TINY, "--kv-cache-bytes"),  # under one 4,096-token sequence
    (VllmWanted(2, kv_cache_bytes=12 * GiB), NODE, TINY, "--kv-cache-bytes"),  # 24 GiB on 22 free
    (VllmWanted(2), NodeMemory(22 * GiB, 23 * GiB, kv_cache_env_gib=16), TINY, "VLLM_CPU_KVCACHE_SPACE"),
    (VllmWanted(2, gpu_memory_utilization=0.92), NODE, TINY, "--gpu-memory-utilization"),  # vLLM's default
])
def test_what_cannot_start_names_the_option(wanted: VllmWanted, node: NodeMemory, model: ModelShape,
                                            option: str) -> None:
    with pytest.raises(ConfigError, match=f"^{option}: "):
        size_cpu_instances(wanted, node, model)


def test_the_kv_of_a_token_from_hugging_face_configs() -> None:
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
             "max_position_embeddings": 4096, "torch_dtype": "float16"}
    assert model_shape_from_config(llama, 1) == ModelShape(1, 524_288, 4096)
    mistral = {**llama, "num_key_value_heads": 8, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
    assert model_shape_from_config(mistral, 1).kv_bytes_per_token == 131_072
    assert model_shape_from_config({**llama, "torch_dtype": "float32"}, 1).kv_bytes_per_token == 1_048_576
    scaled = model_shape_from_config({**llama, "rope_scaling": {"type": "linear", "factor": 4}}, 1)
    assert scaled.max_position_embeddings is None
    assert model_shape_from_config({"text_config": mistral}, 1).kv_bytes_per_token == 131_072
    assert model_shape_from_config({"hidden_size": 64}, 1) == ModelShape(1, None, None)


def test_a_model_directory_is_read_or_refused_naming_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^--model: no model directory"):
        read_model_shape(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="^--model: .* no readable config.json"):
        read_model_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                                      "hidden_size": 128, "max_position_embeddings": 4096}))
    with pytest.raises(ConfigError, match="^--model: .* holds no weights"):
        read_model_shape(str(tmp_path))
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 2000)
    (tmp_path / "tokenizer.model").write_bytes(b"\0" * 7000)
    assert read_model_shape(str(tmp_path)) == ModelShape(5000, 1024, 4096)


def test_vllm_refusals_in_a_log_name_the_option() -> None:
    lines = ["INFO starting", "ValueError: To serve at least one request with the model's max seq len (4096), "
             "(0.00 GiB KV cache is needed, which is larger than the available KV cache memory (0.00 GiB).",
             "RuntimeError: Engine core initialization failed. See root cause above."]
    assert explain_vllm_refusal(lines).startswith("--kv-cache-bytes (or a lower --max-model-len): ValueError: To")
    assert explain_vllm_refusal(["ValueError: No common block size for 48"]).startswith("--block-size: ")
    assert explain_vllm_refusal(["RuntimeError: boom"]) is None


def test_the_sizing_reaches_every_worker_and_autoscale_shares_among_the_most() -> None:
    config = ClusterConfig(engine="vllm", model="/m", instances=2)
    sized = config.with_vllm_sizing(size_cpu_instances(config.vllm_wanted(), NODE, TINY))
    for name, argv in sized.child_argvs():
        if name.startswith("workers-"):
            assert argv[argv.index("--block-size") + 1] == "128"
            assert argv[argv.index("--kv-cache-bytes") + 1] == str(48 * 4096 * 1024)
    from blockq.config import AutoscaleOptions

    scaled = ClusterConfig(engine="vllm", model="/m", instances=1, autoscale=AutoscaleOptions(max_instances=5))
    assert scaled.vllm_wanted().num_instances == 5


def test_up_sizes_on_cpu_and_leaves_other_engines_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import blockq.local.vllm_sizing as sizing_module
    from blockq.local.up import _sized_argv, size_vllm

    monkeypatch.setattr(sizing_module, "vllm_runs_on_cpu", lambda: True)
    monkeypatch.setattr(sizing_module, "measure_node", lambda: NODE)
    monkeypatch.setattr(sizing_module, "read_model_shape", lambda model: TINY)
    config = size_vllm(ClusterConfig(engine="vllm", model=str(tmp_path)))
    assert (config.vllm_block_size, config.vllm_kv_cache_bytes) == (128, 48 * 4096 * 1024)
    assert _sized_argv(config) == ["--block-size", "128", "--kv-cache-bytes", str(48 * 4096 * 1024)]
    assert size_vllm(ClusterConfig()) == ClusterConfig()
    monkeypatch.setattr(sizing_module, "vllm_runs_on_cpu", lambda: False)  # vLLM's GPU build: its own defaults
    assert size_vllm(ClusterConfig(engine="vllm", model="m")).vllm_kv_cache_bytes is None


def test_up_gives_up_at_the_first_will_not_start_exit(tmp_path: Path) -> None:
    from blockq.local.up import _start_failure

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "workers-1.log").write_text(
        "ValueError: No common block size for 48 (CPU_ATTN: [MultipleOf(base=32)]).\n"
        "workers: vLLM will not start: RuntimeError: Engine core initialization failed.\n")
    state = ClusterState(supervisor_pid=1, redis_url="redis://x",
                         child_failures={"workers-1": {"num_restarts": 1, "returncode": WILL_NOT_START_EXIT_CODE}})
    assert _start_failure(tmp_path, state) == ("workers-1 will not start: --block-size: ValueError: No common "
                                               "block size for 48 (CPU_ATTN: [MultipleOf(base=32)]).")
    state.child_failures = {"workers-1": {"num_restarts": 1, "returncode": 1}}
    assert _start_failure(tmp_path, state) is None  # an ordinary crash: restarted, up to 3 times


def test_a_worker_whose_engine_will_not_start_exits_78(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import workers.cli
    from workers.engines.vllm import EngineWillNotStart

    def refuse(args: object, index: int) -> None:
        raise EngineWillNotStart("ValueError: No common block size for 48")

    monkeypatch.setattr(workers.cli, "build_engine", refuse)
    parser = __import__("argparse").ArgumentParser()
    workers.cli.add_arguments(parser)
    args = parser.parse_args(["--redis", "redis://127.0.0.1:9/0", "--engine", "vllm", "--model", "m",
                              "--metrics-port", "off"])
    # run() configures structlog onto this test's captured stderr: put the configuration
    # back, or later tests' log lines go to a closed file
    saved = structlog.get_config()
    try:
        assert workers.cli.run(args) == WILL_NOT_START_EXIT_CODE
    finally:
        structlog.configure(**saved)
    assert "vLLM will not start: ValueError: No common block size" in capsys.readouterr().err


def test_a_given_kv_cache_size_drops_the_legacy_environment_variable() -> None:
    from workers.engines.vllm_options import VllmEngineOptions

    environ = {"VLLM_CPU_KVCACHE_SPACE": "4", "OTHER": "1"}
    VllmEngineOptions(model="m").apply_to_environment(environ)
    assert environ["VLLM_CPU_KVCACHE_SPACE"] == "4"  # no size given: the variable sizes it
    VllmEngineOptions(model="m", kv_cache_bytes=2 * MiB).apply_to_environment(environ)
    assert environ == {"OTHER": "1"}


# --- against vLLM -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import_or_skip("vllm")
    root = tmp_path_factory.mktemp("vllm-defaults")
    return write_tiny_model(root / "model")


def _logs(state_dir: Path) -> str:
    logs = state_dir / "logs"
    return "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log"))) if logs.is_dir() else ""


@pytest.mark.vllm
@pytest.mark.timeout(700)  # two engines compiling their graphs on 2 cores: over 2 minutes here
def test_up_with_no_tuning_flags_comes_up_and_serves(tiny_model: Path, tmp_path: Path) -> None:
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    started_s = time.monotonic()
    up = run_blockq("up", "--engine", "vllm", "--model", str(tiny_model), "--instances", "2",
                    "--metrics-base-port", "0", "--detach", "--json", env=env, timeout_s=660)
    try:
        assert up.returncode == 0, up.stderr[-3000:] + _logs(tmp_path / "state")
        print(f"\n{up.stderr.strip()}\n2 vLLM instances up in {time.monotonic() - started_s:.1f} s")
        assert "vLLM on CPU:" in up.stderr
        submit = run_blockq("submit", "hello there", "--max-tokens", "8", "--json", env=env, timeout_s=60)
        assert submit.returncode == 0, submit.stderr[-3000:]
        record = json.loads(submit.stdout)
        # Random weights may draw the end-of-sequence token early: 1 to 8 tokens, an instance's.
        assert record["status"] == "ok" and 1 <= record["output_tokens"] <= 8, record
        assert record["instance"] in ("inst-0", "inst-1"), record
        _print_memory(tmp_path / "state")
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr


def _print_memory(state_dir: Path) -> None:
    """Each worker's resident memory with its vLLM processes: what INSTANCE_RUNTIME_BYTES covers."""
    import psutil

    state = ClusterState.read(state_dir)
    assert state is not None
    for name, pid in sorted(state.children.items()):
        if name.startswith("workers-"):
            process = psutil.Process(pid)
            rss = sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])
            print(f"{name}: {rss / GiB:.2f} GiB resident with its vLLM processes")


@pytest.mark.vllm
def test_a_budget_that_cannot_fit_fails_at_once_naming_the_option(tiny_model: Path, tmp_path: Path) -> None:
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    started_s = time.monotonic()
    up = run_blockq("up", "--engine", "vllm", "--model", str(tiny_model), "--instances", "2",
                    "--kv-cache-bytes", "65536", "--metrics-base-port", "0", "--detach", env=env, timeout_s=60)
    assert up.returncode != 0 and time.monotonic() - started_s < 30, up.stderr
    assert "--kv-cache-bytes: " in up.stderr, up.stderr
    assert not (tmp_path / "state" / "cluster.json").exists()  # nothing was started


@pytest.mark.vllm
def test_a_refusal_only_vllm_sees_exits_78_and_its_log_names_the_option(tiny_model: Path, tmp_path: Path) -> None:
    """A worker started without `up`'s checks (its raw flag: 64 KiB of KV cache, under one
    4,096-token sequence) fails in vLLM's engine-core process; the worker exits with the
    will-not-start status, and its log holds vLLM's reason that `up` names the option from."""
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log_file:
        worker = subprocess.run(
            [sys.executable, "-m", "workers", "--redis", "redis://127.0.0.1:9/0", "--engine", "vllm",
             "--model", str(tiny_model), "--kv-cache-bytes", "65536", "--block-size", "32", "--enforce-eager",
             "--metrics-port", "off"], stdout=log_file, stderr=subprocess.STDOUT, timeout=110)
    lines = log_path.read_text().splitlines()
    assert worker.returncode == WILL_NOT_START_EXIT_CODE, "\n".join(lines[-30:])
    assert any("vLLM will not start:" in line for line in lines)
    reason = explain_vllm_refusal(lines)
    assert reason is not None and reason.startswith("--kv-cache-bytes"), "\n".join(lines[-30:])
