"""Issue 22, listing at scale: a class 50x the others is listed in balanced tasks, with the rows
one task per class lists (locally, on the S3 server, on the GCS emulator and on Azurite), links,
loops and hidden objects alike; without the sniff, bad objects reach the shard job's decode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import boto3
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines.local_engine import LocalEngine
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.listing import Skip, discover, list_prefix
from jobs.manifest_steps.listing_tasks import _azure_page, _gcs_page, list_lake
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import StorageError
from lakeshard.format import shard_rejects_uri
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import read_table
from tests.helpers.edge_lake import write_edge_lake
from tests.helpers.lake import write_lake

SKIP = Skip(exclude=("*.tmp",))


class CountingEngine:
    """Runs every task on ``engine`` and records how many rows each task returned."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.name = engine.name
        self.rows_per_task: list[int] = []

    @property
    def parallelism(self) -> int:
        return self._engine.parallelism

    def map_partitions(
        self, fn: Callable[[list[Any]], list[Any]], items: Sequence[Any], *, partitions: int
    ) -> list[Any]:
        results = self._engine.map_partitions(lambda part: [fn(part)], items, partitions=partitions)
        self.rows_per_task += [sum(isinstance(r, dict) for r in result) for result in results]
        return [r for result in results for r in result]


def _big_lake() -> dict[str, bytes]:
    """Four classes of 10 objects and one of 500 (300 flat, two sub-folders of 100), with a
    hidden object, an excluded one, odd names and keys that extend other keys."""
    objects = {
        f"{c}/img_{i:03d}.png": b"x" * (i + 1) for c in ("ant", "bee", "cow", "doe") for i in range(10)
    }
    objects |= {f"big/img_{i:05d}.png": b"y" * (i % 7 + 1) for i in range(300)}
    objects |= {f"big/sub{s}/p_{i:04d}.png": b"z" * (i % 5 + 1) for s in (1, 2) for i in range(100)}
    objects |= {
        "big/.DS_Store": b"junk",
        "big/notes.tmp": b"scratch",
        "big/ünï cødé +1.png": b"u",
        "big/img_00007.png.bak": b"b",
        "big/img_00007.png0": b"c",
    }
    return objects


def _write_local(root: Path, objects: dict[str, bytes]) -> str:
    for key, data in objects.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return str(root)


def _write_s3(bucket: str, objects: dict[str, bytes]) -> str:
    client = boto3.client("s3")
    for key, data in objects.items():
        client.put_object(Bucket=bucket[len("s3://") :], Key=f"raw/{key}", Body=data)
    return f"{bucket}/raw"


def _write_store(bucket: str, objects: dict[str, bytes]) -> str:
    for key, data in objects.items():
        storage.write_bytes_atomic(f"{bucket}/raw/{key}", data)
    return f"{bucket}/raw"


def _write(where: str, tmp_path: Path, objects: dict[str, bytes], request: pytest.FixtureRequest) -> str:
    if where == "local":
        return _write_local(tmp_path / "raw", objects)
    if where == "s3":
        return _write_s3(request.getfixturevalue("s3_bucket"), objects)
    return _write_store(
        request.getfixturevalue({"gcs": "gcs_bucket", "azure": "az_container"}[where]), objects
    )


def _today(root: str) -> list[dict[str, Any]]:
    """The rows one task per class prefix lists (the listing before issue 22)."""
    prefixes = discover(root, skip=SKIP).prefixes
    return sorted((r for p in prefixes for r in list_prefix(root, p, skip=SKIP)), key=lambda r: r["key"])


@pytest.mark.parametrize(
    "where",
    [
        "local",
        pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow]),
        pytest.param("gcs", marks=[pytest.mark.gcs, pytest.mark.slow]),
        pytest.param("azure", marks=[pytest.mark.azure, pytest.mark.slow]),
    ],
)
def test_a_class_50x_the_others_is_listed_in_balanced_tasks(where, tmp_path, request):
    objects = _big_lake()
    root = _write(where, tmp_path, objects, request)
    today = _today(root)
    assert len(today) == len(objects)
    prefixes = discover(root, skip=SKIP).prefixes
    engine = CountingEngine(LocalEngine(workers=2))

    rows = list_lake(engine, root, prefixes, skip=SKIP, task_objects=50)

    assert sorted(rows, key=lambda r: r["key"]) == today  # same keys, labels, sizes, ETags, skips
    tasks = engine.rows_per_task
    assert sum(tasks) == len(objects)
    # One task per class would list 505 of 545 objects in one task; no task lists more than 50.
    assert max(tasks) <= 50, tasks
    assert len([n for n in tasks if n > 0]) >= len(objects) // 50
    # The count sees the imbalance it rules out: with a budget above the lake, one task per class.
    whole = CountingEngine(LocalEngine(workers=2))
    list_lake(whole, root, prefixes, skip=SKIP, task_objects=10**6)
    assert sorted(whole.rows_per_task) == [10, 10, 10, 10, 505]


@pytest.mark.parametrize("budget", [1, 2, 5])
def test_links_loops_and_hidden_objects_list_alike_in_small_tasks(tmp_path, budget):
    raw = write_edge_lake(tmp_path)
    (raw / "ghost").symlink_to("../no-such-class")
    today = _today(str(raw))
    prefixes, _ = discover(str(raw), skip=SKIP)
    engine = CountingEngine(LocalEngine(workers=2))
    rows = list_lake(engine, str(raw), prefixes, skip=SKIP, task_objects=budget)
    assert sorted(rows, key=lambda r: r["key"]) == today
    assert {r["status"] for r in today} == {"ok", "rejected", "skipped"}
    assert max(engine.rows_per_task) <= budget


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("gcs", marks=pytest.mark.gcs),
        pytest.param("azure", marks=pytest.mark.azure),
    ],
)
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_keys_that_extend_the_last_listed_key_are_not_lost(where, budget, tmp_path, request):
    keys = ("c/a", "c/a0", "c/a00", "c/a0/x", "c/ab", "c/b", "c/b/c/d", "d/a")
    root = _write(where, tmp_path, {k: b"k" for k in keys}, request)
    prefixes, _ = discover(root)
    rows = list_lake(LocalEngine(workers=2), root, prefixes, task_objects=budget)
    assert sorted(r["key"] for r in rows) == [
        "c/a",
        "c/a0",
        "c/a0/x",
        "c/a00",
        "c/ab",
        "c/b",
        "c/b/c/d",
        "d/a",
    ]


@pytest.mark.parametrize("after", ["raw/c/b", "raw/c/bb"])
@pytest.mark.parametrize(
    ("where", "pager"),
    [
        pytest.param("gcs", _gcs_page, marks=pytest.mark.gcs),
        pytest.param("azure", _azure_page, marks=pytest.mark.azure),
    ],
)
def test_pages_after_a_key_there_or_gone_lose_none(where, pager, after, tmp_path, request):
    """GCS's ``startOffset`` and Azure's ``startFrom`` include the key they name: a page drops it,
    and where it is gone (deleted since it was listed) keeps the one more key it asked for rather
    than skip it."""
    root = _write(where, tmp_path, {f"c/{k}": b"k" for k in "abcdef"}, request)
    fs, _ = storage.filesystem(root)
    bucket, names, token = root.split("://", 1)[1].split("/", 1)[0], [], None
    while True:
        page = pager(fs, bucket, "raw/c/", after, 2, token)
        names += [i["name"] for i in page.infos]
        if page.token is None:
            break
        token = page.token
    assert names == [f"{bucket}/raw/c/{k}" for k in "cdef"]


@pytest.mark.azure
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_azure_folders_of_a_hierarchical_namespace_are_no_rows_and_lose_no_keys(az_container, budget, caplog):
    """A hierarchical namespace lists each folder as a blob of its own (``hdi_isfolder``
    metadata): the pages seek past it as a key, only files become rows, as adlfs's ``find``
    lists them, a class with a folder blob is one class (adlfs lists it twice), and a piece of a
    class holding only a folder's blob (``c/sub2``) is no "holds no objects" warning."""
    from lakeshard.storage import azure_client

    blobs = azure_client().get_container_client(az_container[len("az://") :])
    for name in ("raw/c/a", "raw/c/sub/x", "raw/c/sub/y", "raw/c/z", "raw/d/w"):
        blobs.upload_blob(name, b"k")
    for folder in ("raw/c/sub", "raw/c/sub2", "raw/d"):
        blobs.upload_blob(folder, b"", metadata={"hdi_isfolder": "true"})
    root = f"{az_container}/raw"
    rows = list_lake(LocalEngine(workers=2), root, discover(root).prefixes, task_objects=budget)
    assert sorted(r["key"] for r in rows) == ["c/a", "c/sub/x", "c/sub/y", "c/z", "d/w"]
    assert sorted(rows, key=lambda r: r["key"]) == _today(root)
    assert "holds no objects" not in caplog.text


@pytest.mark.azure
def test_an_azure_endpoint_that_ignores_start_from_stops_the_listing_with_what_to_do(tmp_path, monkeypatch):
    """Azurite 3.35 (as a service before version 2026-02-06) lists from the first blob whatever
    ``startFrom`` says: a class cut into tasks would repeat keys, so the listing stops with an
    error naming the way out, and a budget above the class lists it in one task, the same rows."""
    from lakeshard.storage import azure_client
    from tests.helpers.azurite import Azurite, connection_string, require_old_azurite

    old = Azurite(require_old_azurite()).start()
    try:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(old.endpoint))
        azure_client().create_container("lake")
        root = _write_store("az://lake", {f"c/{i:02d}": b"k" for i in range(12)})
        prefixes = discover(root).prefixes
        with pytest.raises(StorageError, match="this Azure endpoint ignores List Blobs' startFrom") as info:
            list_lake(LocalEngine(workers=2), root, prefixes, task_objects=5)
        assert "pass a --list-task-objects above the largest class's blob count" in str(info.value)
        rows = list_lake(LocalEngine(workers=2), root, prefixes, task_objects=12)
        assert sorted(rows, key=lambda r: r["key"]) == _today(root)
        assert len(rows) == 12
    finally:
        old.stop()


def test_without_the_sniff_a_bad_object_is_rejected_by_the_shard_job(tmp_path):
    raw = tmp_path / "raw"
    write_lake(raw, {"cat": 8, "dog": 8}, nested=False)
    (raw / "cat" / "readme.jpg").write_bytes(b"plain text pretending to be a jpeg")
    (raw / "dog" / "empty.png").write_bytes(b"")
    engine = LocalEngine(workers=2)
    reasons = {}
    for sniff in (True, False):
        out = storage.normalize(str(tmp_path / f"sniff-{sniff}"))
        manifest_job.run(
            ManifestConfig(
                input=str(raw),
                output=out,
                sniff=sniff,
                split={"train": 1.0},
                max_reject_fraction=0.5,
                engine="local",
            ),
            engine,
        )
        rejects = read_channel(out, "rejects")
        reasons[sniff] = dict(zip(rejects["key"].to_pylist(), rejects["reason"].to_pylist(), strict=True))
        if not sniff:
            train = {r["key"]: r for r in read_channel(out, "train").to_pylist()}
            assert train["cat/readme.jpg"]["format"] is None and train["cat/readme.jpg"]["etag"] is None
            shard_job.run(
                ShardConfig(
                    dataset=out, num_shards=1, image_size=16, max_reject_fraction=0.5, engine="local"
                ),
                engine,
            )
            shard_rejects = read_table(shard_rejects_uri(out))["key"].to_pylist()
            assert shard_rejects == ["cat/readme.jpg"]
    assert reasons[True]["cat/readme.jpg"].startswith("not an image")
    assert reasons[False] == {"dog/empty.png": "empty object (0 bytes)"}  # still rejected: its listed size


def test_many_classes_are_listed_a_few_to_a_task(tmp_path):
    """Forty small classes on two cores: at most four tasks per core, every object listed once
    (one task per class would be forty engine tasks, each a part file in the manifest job)."""
    objects = {f"class_{c:02d}/img_{i}.png": b"x" * (c + i + 1) for c in range(40) for i in range(3)}
    root = _write_local(tmp_path / "raw", objects)
    prefixes = discover(root, skip=SKIP).prefixes
    engine = CountingEngine(LocalEngine(workers=2))

    rows = list_lake(engine, root, prefixes, skip=SKIP, task_objects=1000)

    assert sorted(rows, key=lambda r: r["key"]) == _today(root)
    assert len(prefixes) == 40 and len(engine.rows_per_task) == 8 and sum(engine.rows_per_task) == 120
