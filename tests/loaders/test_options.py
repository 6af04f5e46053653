"""The loader's options, each defined once (``loaders.options``): the loaders' keyword-only
parameters, the groups, the options table the trainer's and the doctor's flags come from,
``ReadPlan`` and errors that carry the option they concern."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lakeshard.errors import ConfigError
from lakeshard.storage import CLIENT_CONNECTIONS
from loaders import Cost, Decoding, LoaderOptions, MixedLoader, Preparation, RemoteReads, ShardLoader
from loaders.doctor.config import NOT_FLAGS as DOCTOR_NOT_FLAGS
from loaders.doctor.config import DoctorConfig
from loaders.doctor.config import build_parser as doctor_parser
from loaders.options import GROUPS, OPTIONS, ReadPlan, loader_flag_names, read_plan
from loaders.train.config import NOT_FLAGS as TRAIN_NOT_FLAGS
from loaders.train.config import OWN_DEFAULTS, TrainConfig, parse_args
from loaders.train.config import build_parser as train_parser

REPO = Path(__file__).resolve().parents[2]


# -- the loaders' parameters ---------------------------------------------------------------------
@pytest.mark.parametrize("loader", [ShardLoader, MixedLoader])
def test_every_option_is_a_typed_keyword_only_parameter_of_the_loaders(loader):
    """The signature is what an IDE and a type checker read: every option of the table, under
    its own name and type, and each group; no ``**kwargs``."""
    params = inspect.signature(loader.__init__).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    keyword_only = {name: p for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    own = {"options"} | ({"samples_per_epoch", "labels"} if loader is MixedLoader else set())
    assert set(keyword_only) == set(OPTIONS) | set(GROUPS) | own
    for name, row in OPTIONS.items():
        refused = loader is MixedLoader and name in ("drop_last", "remainder")  # typed None: refused
        assert keyword_only[name].annotation == ("None" if refused else row.type), name
    for name, kind in GROUPS.items():
        assert keyword_only[name].annotation == f"{kind.__name__} | None"


def test_options_in_groups_are_the_same_options_as_keywords(dataset: Path):
    flat = ShardLoader(
        dataset, batch_size=4, read_concurrency=3, cache_limit="1GiB", augment=True, crop=6, on_budget="stop"
    )
    grouped = ShardLoader(
        dataset,
        batch_size=4,
        reads=RemoteReads(read_concurrency=3, cache_limit="1GiB"),
        decoding=Decoding(augment=True, crop=6),
        cost=Cost(on_budget="stop"),
    )
    with flat, grouped:
        assert flat.options == grouped.options
        assert grouped.options.cache_limit == 1 << 30 and grouped.options.crop == 6  # by their own names too
        assert [b[1].tolist() for b in flat] == [b[1].tolist() for b in grouped]


@pytest.mark.parametrize(
    "keywords, option",
    [
        (dict(reads=RemoteReads(read_concurrency=2), read_concurrency=4), "read_concurrency"),
        (dict(decoding=Decoding(augment=True), augment=False), "augment"),
        (dict(cost=Cost(cost_budget=1.0), cost_budget=2.0), "cost_budget"),
        (dict(preparation=Preparation(prep_timeout=5), prep_timeout=6), "prep_timeout"),
    ],
)
def test_an_option_given_both_by_itself_and_in_its_group_is_refused_naming_it(dataset, keywords, option):
    group = next(g for g in GROUPS if g in keywords)
    for make in (lambda: ShardLoader(dataset, **keywords), lambda: MixedLoader([dataset], **keywords)):
        with pytest.raises(ConfigError, match=rf"^{option} is an option of {group}=: .*not both") as refused:
            make()
        assert refused.value.option == option


def test_options_at_once_exclude_keywords_and_a_mixture_refuses_what_does_not_apply(dataset: Path):
    options = LoaderOptions(batch_size=4, reads=RemoteReads(read_concurrency=2))
    with pytest.raises(ConfigError, match=r"not both \(got \['reads'\]\)"):
        ShardLoader(dataset, options=options, reads=RemoteReads())
    with MixedLoader([dataset], options=options) as mixed:
        assert mixed.options == options
    with pytest.raises(ConfigError, match="drop_last does not apply to a mixture") as refused:
        MixedLoader([dataset], options=LoaderOptions(drop_last=True))
    assert refused.value.option == "drop_last"
    with pytest.raises(ConfigError, match="remainder does not apply to a mixture"):
        MixedLoader([dataset], remainder="pad")  # type: ignore[arg-type]


def test_a_group_of_the_wrong_kind_is_refused():
    with pytest.raises(
        ConfigError, match=r"reads must be a loaders.options.RemoteReads, got Cost\("
    ) as refused:
        LoaderOptions(reads=Cost())  # type: ignore[arg-type]
    assert refused.value.option == "reads"


def test_replace_checks_again_and_keeps_every_other_option():
    options = LoaderOptions.from_keywords(dict(batch_size=4, memory_budget="1MiB", augment=True, seed=3))
    changed = options.replace(memory_budget=2 << 20, rank=1, world_size=2)
    assert (changed.memory_budget, changed.rank, changed.augment, changed.seed) == (2 << 20, 1, True, 3)
    with pytest.raises(ConfigError, match="rank must be an integer in"):
        options.replace(rank=1)


# -- errors carry their option -------------------------------------------------------------------
@pytest.mark.parametrize(
    "keywords, option",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(rank=3), "rank"),
        (dict(channel="dev"), "channel"),
        (dict(read_concurrency=CLIENT_CONNECTIONS + 1), "read_concurrency"),
        (dict(memory_budget="plenty"), "memory_budget"),
        (dict(normalize=(0.5, 0.5)), "normalize"),
        (dict(transform="no_such_pkg.aug:crop"), "transform"),
        (dict(transform=lambda *a: a, crop=4), "transform"),
        (dict(decoder="none", pin_memory=True), "decoder"),
        (dict(prep="tcp://h:1", decoder="none"), "prep"),
        (dict(prep_security={"ca_file": "x"}), "prep_security"),
        (dict(prices={"get": 1}), "prices"),
        (dict(on_budget="panic"), "on_budget"),
    ],
)
def test_every_refused_option_is_named_as_data(keywords, option):
    with pytest.raises(ConfigError) as refused:
        LoaderOptions.from_keywords(keywords)
    assert refused.value.option == option, str(refused.value)


def test_a_command_names_the_flag_from_the_errors_option(tmp_path: Path):
    with pytest.raises(
        ConfigError, match=r"^--prefetch \(command line\): must be a positive integer, got 0$"
    ) as e:
        parse_args(["--dataset", "x", "--prefetch", "0"])
    assert e.value.option == "prefetch"
    conf = tmp_path / "c.yaml"
    conf.write_text("dataset: x\nread_concurrency: 100\n")
    with pytest.raises(
        ConfigError, match=rf"^--read-concurrency \(--conf .*c.yaml\): must be at most {CLIENT_CONNECTIONS} "
    ):
        parse_args(["--conf", str(conf)])


# -- ReadPlan ------------------------------------------------------------------------------------
def test_read_concurrency_is_derived_in_one_place_within_the_clients_connections(caplog, monkeypatch):
    monkeypatch.setattr(read_plan, "_LOGGED", set())  # a clamp is logged once a process
    with caplog.at_level(logging.INFO, logger="loaders.options.read_plan"):
        assert LoaderOptions.from_keywords(dict(read_concurrency=17)).read_plan.first_batch_parts == 3
    assert "read_concurrency=17: an epoch's first reads go in 3 parts each, not 17" in caplog.text
    assert ReadPlan.of(8) == ReadPlan(
        in_flight=8, fetch_threads=8, footer_threads=8, first_batch_parts=8, read_ahead=8
    )
    for c in range(1, CLIENT_CONNECTIONS + 1):
        plan = ReadPlan.of(c)
        assert plan.in_flight == plan.fetch_threads == plan.footer_threads == plan.read_ahead == c
        assert 1 <= plan.first_batch_parts <= c
        assert plan.in_flight * plan.first_batch_parts <= CLIENT_CONNECTIONS
    with pytest.raises(ConfigError, match=rf"read_concurrency must be at most {CLIENT_CONNECTIONS}"):
        RemoteReads(read_concurrency=CLIENT_CONNECTIONS + 1)


# -- the commands' flags, made from the table ----------------------------------------------------
@pytest.mark.parametrize(
    "config, not_flags",
    [(TrainConfig, TRAIN_NOT_FLAGS), (DoctorConfig, DOCTOR_NOT_FLAGS)],
    ids=["train", "doctor"],
)
def test_every_option_is_a_flag_of_each_command_or_said_why_not(config, not_flags):
    flags = set(loader_flag_names(config))
    assert flags | set(not_flags) == set(OPTIONS), set(OPTIONS) - flags - set(not_flags)
    assert not flags & set(not_flags)
    for name in flags:
        assert OPTIONS[name].command_type is not None


@pytest.mark.parametrize(
    "config, parser, own",
    [(TrainConfig, train_parser, OWN_DEFAULTS), (DoctorConfig, doctor_parser, {})],
    ids=["train", "doctor"],
)
def test_help_lists_every_loader_flag_with_the_librarys_default(config, parser, own, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = capsys.readouterr().out
    helps = {a.dest: " ".join((a.help or "").split()) for a in parser()._actions}
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in loader_flag_names(config):
        row = OPTIONS[name]
        assert row.flag in text, name
        assert defaults[name] == row.default or name in own, name
        assert helps[name].startswith(" ".join(row.help.split())) or name in own, name
        default = defaults[name]
        if isinstance(default, bool):
            assert helps[name].endswith(f"(default: {'on' if default else 'off'})"), name
        elif default is not None:
            assert helps[name].endswith(f"(default: {default})"), name
    assert set(own) <= set(loader_flag_names(config))


# -- sizes -----------------------------------------------------------------------------------------
def test_no_function_of_the_options_is_over_60_lines():
    for path in sorted((REPO / "loaders" / "options").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{path.name}: {node.name}"


@pytest.mark.slow
def test_a_type_checker_sees_the_loaders_parameters(tmp_path: Path):
    """mypy (as scripts/test.sh runs it) refuses a misspelt option and one of the wrong type."""
    use = tmp_path / "use_loader.py"
    use.write_text(
        "from loaders import ShardLoader\n"
        "ShardLoader('ds', batch_size=8, read_concurrency=4)\n"
        "ShardLoader('ds', batch_sise=8)\n"
        "ShardLoader('ds', read_concurrency='4')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(use)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if "use_loader.py" in line and ": error:" in line]
    assert len(lines) == 2, done.stdout
    assert 'Unexpected keyword argument "batch_sise"' in lines[0]
    assert (
        'Argument "read_concurrency" to "ShardLoader" has incompatible type "str"; expected "int"' in lines[1]
    )


def test_the_trainers_page_names_every_loader_flag_of_the_trainer():
    page = (REPO / "docs" / "training.md").read_text()
    for name in loader_flag_names(TrainConfig):
        assert f"`{OPTIONS[name].flag}`" in page, name


def test_the_docs_list_every_option_with_its_default():
    api = (REPO / "docs" / "loader.md").read_text().split("\n## API\n")[1].split("\n## ")[0]
    table = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", api, re.MULTILINE)}
    for name, row in OPTIONS.items():
        assert name in table, name
        if row.default is not None:
            assert f"`{row.default!r}`".replace("'", '"') in table[name], name
