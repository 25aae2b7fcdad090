"""`blockq up` configuration: the shipped TOML parses; bad values name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockq.cluster_config import ClusterConfig
from blockq.config import ConfigError, Settings
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


def test_env_settings_are_validated() -> None:
    assert Settings.from_env({"BLOCKQ_REDIS_URL": "rediss://u:p@h:6380/0"}).redis_url == "rediss://u:p@h:6380/0"
    with pytest.raises(ConfigError, match="redis_url: scheme"):
        Settings.from_env({"BLOCKQ_REDIS_URL": "http://x"})
    with pytest.raises(ConfigError, match="BLOCKQ_MAX_BACKLOG: must be an integer"):
        Settings.from_env({"BLOCKQ_MAX_BACKLOG": "lots"})
