"""``blockq profile`` and ``blockq fidelity`` on a real vLLM engine (``make test-vllm``).

On the ``medium`` tiny model (the default ``small`` one's steps are mostly vLLM's per-step
overhead, a few ms, as noisy as they are short), with a smaller engine than the figures of
docs/results/engine-fidelity.md: a short run checks that the profile fits and that the
engine model, given it, forecasts the engine's requests; loose bounds, as a 24-request run
on a shared CI machine is noisy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import import_or_skip, run_blockq, write_tiny_model

import_or_skip("vllm")

pytestmark = pytest.mark.vllm

ENGINE = ("--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
          "--block-size", "32", "--kv-cache-bytes", str(32 * 1024 * 1024))


@pytest.fixture(scope="module")
def model_and_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    root = tmp_path_factory.mktemp("fidelity")
    write_tiny_model(root / "model", "--size", "medium", "--max-model-len", "1024")
    profiled = run_blockq("profile", "--model", str(root / "model"), *ENGINE, "--out",
                          str(root / "profile.json"), timeout_s=600)
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    yield root / "model", root / "profile.json", profiled.stdout


def test_profile_fits_every_kind_of_step(model_and_profile: tuple[Path, Path, str]) -> None:
    _, profile_path, report = model_and_profile
    profile = json.loads(profile_path.read_text())
    assert profile["kind"] == "blockq-engine-profile"
    assert profile["engine_config"]["max_num_seqs"] == 8 and profile["engine_config"]["block_size"] == 32
    for kind in ("prefill", "decode", "mixed"):
        assert kind in report
        assert profile["fit"][kind]["num_steps"] >= 20
        assert profile["fit"][kind]["rel_error_p50"] < 0.15, profile["fit"]


def test_fidelity_forecasts_the_engines_requests(model_and_profile: tuple[Path, Path, str],
                                                 tmp_path: Path) -> None:
    model, profile_path, _ = model_and_profile
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{40 + (97 * i) % 500},{10 + (53 * i) % 150}\n" for i in range(64)))
    ran = run_blockq("fidelity", "--model", str(model), "--trace", str(trace), "--loads", "0.6",
                     "--requests", "24", "--seed", "1", "--prefix-caching", "--profile", str(profile_path),
                     *ENGINE, "--json", timeout_s=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(ran.stdout)
    assert report["capacity_rps"] > 0
    (row,) = report["results"]
    assert row["num_requests"] == 24 and row["load"] == 0.6
    assert row["rate"] == pytest.approx(0.6 * report["capacity_rps"], rel=1e-3)
    assert row["e2e_ape_p50"] < 0.15, row
    assert abs(row["ttft_mean_rel_err"]) < 0.35, row
    # 8 groups share a prefix: vLLM's hits and the engine model's, from the same token ids.
    assert row["prefix_hit_tokens_real"] > 0
    assert row["prefix_hit_tokens_sim"] == pytest.approx(row["prefix_hit_tokens_real"], rel=0.25), row
    assert report["steps"]["step_ape_p50"] < 0.2, report["steps"]
