from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from jobs.manifest import parser as manifest_parser
from jobs.manifest_steps.config import ManifestConfig, parse_split
from jobs.shard import parser as shard_parser
from jobs.shard_steps.config import ShardConfig
from lakeshard.errors import ConfigError
from lakeshard.settings import MAX_SEED, check_seed, opt, parse_seed, parse_size, resolve


@pytest.mark.parametrize(
    "text,expected",
    [("128MiB", 128 * 2**20), ("4MB", 4_000_000), ("512", 512), ("1.5KiB", 1536), (1024, 1024)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "MiB", "-3", True, 1.5, "2.5B"])
def test_parse_size_names_the_bad_value(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad)) if not isinstance(bad, bool) else "True"):
        parse_size(bad)


def test_parse_split_keeps_order_and_checks_sum():
    assert list(parse_split("test=0.2,train=0.8")) == ["test", "train"]
    with pytest.raises(ValueError, match=r"add up to 1, got 0\.9"):
        parse_split("train=0.8,test=0.1")
    with pytest.raises(ValueError, match="'train' appears twice"):
        parse_split("train=0.5,train=0.5")
    with pytest.raises(ValueError, match="'validation' must be a number, got 'x'"):
        parse_split("train=0.5,validation=x")


def test_yaml_then_command_line(tmp_path):
    conf = tmp_path / "m.yaml"
    conf.write_text(
        "input: /lake/raw\noutput: /out\nseed: 3\nsplit: {train: 0.5, test: 0.5}\nmin_per_class: 2\n"
    )
    args = manifest_parser().parse_args(["--conf", str(conf), "--seed", "9"])
    cfg = resolve(ManifestConfig, args)
    assert (cfg.input, cfg.seed, cfg.min_per_class, cfg.split) == (
        "/lake/raw",
        9,
        2,
        {"train": 0.5, "test": 0.5},
    )


def test_unknown_yaml_key_is_named_with_its_file(tmp_path):
    conf = tmp_path / "m.yaml"
    conf.write_text("input: /x\noutput: /y\nnum_shard: 4\n")
    with pytest.raises(ConfigError, match=f"unknown key 'num_shard' in {conf}"):
        resolve(ManifestConfig, conf=str(conf))


def test_bad_value_names_flag_and_source(tmp_path):
    conf = tmp_path / "s.yaml"
    conf.write_text("dataset: /d\nnum_shards: four\n")
    with pytest.raises(ConfigError, match=r"--num-shards \(.*s.yaml\): expected an integer|invalid literal"):
        resolve(ShardConfig, conf=str(conf))
    with pytest.raises(
        ConfigError, match=r"^--num-shards \(command line\): must be a positive integer, got 0$"
    ):
        resolve(ShardConfig, shard_parser().parse_args(["--dataset", "/d", "--num-shards", "0"]))


def test_missing_required_option_is_named():
    with pytest.raises(ConfigError, match="--input, --output"):
        resolve(ManifestConfig, manifest_parser().parse_args([]))


def test_shipped_config_files_load(tmp_path):
    m = resolve(ManifestConfig, {"input": "/a", "output": "/b"}, conf="conf/manifest.yaml")
    s = resolve(ShardConfig, {"dataset": "/b"}, conf="conf/shard.yaml")
    assert m.split == {"train": 0.8, "validation": 0.1, "test": 0.1}
    assert s.row_group_size == 4 * 2**20


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        shard_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--num-shards",
        "--image-size",
        "--remainder",
        "--row-group-size",
        "--engine",
        "--overwrite",
    ):
        assert flag in text
    assert "(default: 224)" in text


@pytest.mark.parametrize("split", ["train=0.9,val=0.1", "train=0.8,valid=0.2", "training=1"])
def test_unknown_channel_names_are_refused_naming_the_allowed(split):
    bad = split.split(",")[-1].split("=")[0]
    with pytest.raises(
        ConfigError, match=rf"--split \(command line\): unknown channel '{bad}'.*train, validation, test"
    ):
        resolve(
            ManifestConfig,
            manifest_parser().parse_args(["--input", "/a", "--output", "/b", "--split", split]),
        )


@pytest.mark.parametrize("split", ["train=1", "train=0.9,validation=0.1", "test=0.5,train=0.5"])
def test_a_subset_of_the_channels_is_allowed(split):
    cfg = resolve(ManifestConfig, {"input": "/a", "output": "/b", "split": split})
    assert set(cfg.split) <= {"train", "validation", "test"} and abs(sum(cfg.split.values()) - 1) < 1e-9


def test_yaml_lists_give_one_error_naming_key_value_and_file(tmp_path):
    conf = tmp_path / "m.yaml"
    conf.write_text("input: /a\noutput: /b\nsplit: [train, validation]\n")
    with pytest.raises(
        ConfigError,
        match=rf"--split \(--conf {re.escape(str(conf))}\): split must be a mapping .* "
        r"got a list: \['train', 'validation'\]",
    ):
        resolve(ManifestConfig, conf=str(conf))
    shard_conf = tmp_path / "s.yaml"
    shard_conf.write_text("dataset: /d\nchannels: [train, validation]\n")
    with pytest.raises(
        ConfigError,
        match=rf"--channels \(--conf {re.escape(str(shard_conf))}\): expected a single str, "
        r"got a list: \['train', 'validation'\]",
    ):
        resolve(ShardConfig, conf=str(shard_conf))


def test_a_seed_beyond_32_bits_is_named_with_its_source(tmp_path):
    conf = tmp_path / "m.yaml"
    conf.write_text(f"input: /a\noutput: /b\nseed: {2**32}\n")
    with pytest.raises(
        ConfigError,
        match=rf"--seed \(--conf {re.escape(str(conf))}\): .*\[0, 2\*\*32 - 1 = 4294967295\], "
        r"got 4294967296",
    ):
        resolve(ManifestConfig, conf=str(conf))
    with pytest.raises(ConfigError, match=r"--seed \(command line\): .* got '-1'"):
        resolve(
            ManifestConfig, manifest_parser().parse_args(["--input", "/a", "--output", "/b", "--seed", "-1"])
        )
    assert resolve(ManifestConfig, {"input": "/a", "output": "/b", "seed": str(2**32 - 1)}).seed == 2**32 - 1
    # The shard job's own --seed is held to the same range.
    with pytest.raises(
        ConfigError, match=r"--seed \(command line\): .*\[0, 2\*\*32 - 1 = 4294967295\], got '4294967296'"
    ):
        resolve(ShardConfig, shard_parser().parse_args(["--dataset", "/d", "--seed", str(2**32)]))
    assert resolve(ShardConfig, {"dataset": "/d"}).seed is None
    assert resolve(ShardConfig, {"dataset": "/d", "seed": "7"}).seed == 7


def test_exclude_is_repeatable_and_comes_from_yaml(tmp_path):
    conf = tmp_path / "m.yaml"
    conf.write_text("input: /a\noutput: /b\nexclude: ['*.tmp', 'drafts']\ninclude_hidden: true\n")
    assert resolve(ManifestConfig, conf=str(conf)).exclude == ("*.tmp", "drafts")
    args = manifest_parser().parse_args(["--conf", str(conf), "--exclude", "*.bak", "--exclude", "old/*"])
    cfg = resolve(ManifestConfig, args)
    assert (cfg.exclude, cfg.include_hidden) == (("*.bak", "old/*"), True)
    assert resolve(ManifestConfig, {"input": "/a", "output": "/b"}).exclude == ()


@dataclass(frozen=True, slots=True)
class _Fits:
    size: int = opt(1, help="a size")
    width: int = opt(2, help="a width")

    def __post_init__(self) -> None:
        if self.size > self.width:  # a message that does not start with the option's name
            raise ConfigError(f"a size of {self.size} does not fit in {self.width}", option="size")


def test_a_checks_error_names_the_flag_from_its_option_not_its_message():
    with pytest.raises(ConfigError, match=r"^--size \(command line\): a size of 5 does not fit in 2$") as e:
        resolve(_Fits, {"size": "5"})
    assert e.value.option == "size"


@pytest.mark.parametrize(
    "cls,given,option",
    [
        (ShardConfig, {"dataset": "/d", "num_shards": 0}, "num_shards"),
        (ShardConfig, {"dataset": "/d", "quality": 0}, "quality"),
        (ShardConfig, {"dataset": "/d", "row_group_size": "lots"}, "row_group_size"),
        (ManifestConfig, {"input": "/a", "output": "/b", "split": "train=0.5"}, "split"),
        (ManifestConfig, {"input": "/a", "output": "/b", "seed": -1}, "seed"),
        (ManifestConfig, {"input": "/a", "output": "/b", "max_reject_fraction": 2.0}, "max_reject_fraction"),
    ],
)
def test_a_job_configs_checks_carry_their_option(cls, given, option):
    with pytest.raises(ConfigError) as e:
        cls(**given)
    assert e.value.option == option


def test_one_seed_rule_for_jobs_trainer_and_loader():
    from loaders.options.values import seed as loader_seed
    from loaders.train.config import MAX_SEED as TRAIN_MAX_SEED

    assert TRAIN_MAX_SEED == MAX_SEED == 2**32 - 1
    assert parse_seed(str(MAX_SEED)) == check_seed("seed", MAX_SEED) == loader_seed("seed", MAX_SEED)
    for check in (check_seed, loader_seed):
        with pytest.raises(ConfigError, match=r"^seed must be at most 4294967295 \(2\*\*32 - 1\)") as e:
            check("seed", 2**32)
        assert e.value.option == "seed"
    with pytest.raises(ValueError, match="expected an integer from 0 to 4294967295"):
        parse_seed(str(2**32))
