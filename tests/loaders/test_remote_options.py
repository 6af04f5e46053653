"""The remote-read and cache options: on the loader, in the trainer's config, and from the
environment (LAKESHARD_CACHE_DIR)."""

from __future__ import annotations

import pytest

from lakeshard.errors import ConfigError
from loaders import LoaderOptions, RemoteReads
from loaders.train.config import parse_args


def test_trainer_flags_reach_the_loader_options(tmp_path):
    cfg = parse_args(
        [
            "--dataset",
            "x",
            "--cache-dir",
            str(tmp_path),
            "--cache-limit",
            "2GiB",
            "--memory-budget",
            "512MiB",
            "--read-concurrency",
            "3",
        ]
    )
    assert (cfg.cache_dir, cfg.cache_limit, cfg.memory_budget, cfg.read_concurrency) == (
        str(tmp_path),
        "2GiB",
        "512MiB",
        3,
    )
    opts = LoaderOptions(
        reads=RemoteReads(
            cache_dir=cfg.cache_dir,
            cache_limit=cfg.cache_limit,
            memory_budget=cfg.memory_budget,
            read_concurrency=cfg.read_concurrency,
        )
    )
    assert (opts.cache_limit, opts.memory_budget) == (2 << 30, 512 << 20)
    with pytest.raises(
        ConfigError, match=r"--memory-budget \(command line\): a size must look like .*'plenty'"
    ):
        parse_args(["--dataset", "x", "--memory-budget", "plenty"])
    with pytest.raises(ConfigError, match=r"read_concurrency must be a positive integer, got 0"):
        RemoteReads(read_concurrency=0)


def test_the_cache_folder_comes_from_the_environment_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv("LAKESHARD_CACHE_DIR", str(tmp_path / "env"))
    assert LoaderOptions().cache_dir == str(tmp_path / "env")
    assert RemoteReads(cache_dir=str(tmp_path / "given")).cache_dir == str(tmp_path / "given")
    monkeypatch.delenv("LAKESHARD_CACHE_DIR")
    assert LoaderOptions().cache_dir is None
