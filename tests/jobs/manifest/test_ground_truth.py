"""Issue 23: a SageMaker Ground Truth augmented manifest as the lake and its labels
(``--input-manifest``, ``--label-attribute``), local and on the S3 server, on every engine: the
listed objects are the manifest's source-refs, each labelled with its class name; a failed line
is a counted reject, a missing object and a source-ref outside ``--input`` are counted, a key
labelled two ways fails before any image is read, and a bad manifest fails before an engine
starts naming the URI, the line and the value."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.ground_truth import _lines
from jobs.manifest_steps.ground_truth_lines import CHECK_LINES
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import ConfigError, ManifestError
from lakeshard.format import read_dataset_info, read_manifest_info
from lakeshard.format.manifest_table import read_channel
from lakeshard.storage import AzureStore, GCSStore
from tests.helpers.incremental import assert_same_tables
from tests.helpers.lake import encode, make_image

ATTR = "animal"
SPLIT = {"train": 0.6, "validation": 0.2, "test": 0.2}
CLASSES = ("cat", "dog", "fox")
#: The lake: 24 images, flat and in folders that are not labels.
OBJECTS = {(f"img_{i:03d}.png" if i % 4 else f"shoot{i % 3}/img_{i:03d}.png"): i for i in range(24)}
FAILED = "img_005.png"  # in the lake; its line has no label (the worker failed)
UNLISTED = "img_006.png"  # in the lake, not in the manifest: not an object of this dataset
GHOST = "img_999.png"  # a line whose object does not exist
FOLDER = "shoot0"  # a line naming a folder (an S3 prefix), not an object
HIDDEN = ".trash/img_000.png"  # a line naming a hidden key: skipped, as a listing skips it
OUTSIDE_KEY = "elsewhere/img_000.png"  # a line whose object is outside --input (relative to the base)


def _class(i: int) -> str:
    return CLASSES[i % 3]


def _line(uri: str, i: int) -> dict[str, Any]:
    """The Ground Truth line of image ``i``, in one of the shapes a classification job writes:
    a class index with its class-name, a class index with a class-map, a class name."""
    meta: dict[str, Any] = {
        "type": "groundtruth/image-classification",
        "job-name": "labeling-job/animals",
        "human-annotated": "yes",
        "confidence": 0.9,
    }
    shape = (i // 3) % 3
    if shape == 0:
        return {
            "source-ref": uri,
            ATTR: CLASSES.index(_class(i)),
            f"{ATTR}-metadata": {**meta, "class-name": _class(i)},
        }
    if shape == 1:  # the class-map lists the classes in another order than CLASSES
        order = sorted(CLASSES, reverse=True)
        return {
            "source-ref": uri,
            ATTR: order.index(_class(i)),
            f"{ATTR}-metadata": {**meta, "class-map": {str(n): c for n, c in enumerate(order)}},
        }
    return {"source-ref": uri, ATTR: _class(i), f"{ATTR}-metadata": meta}


def _manifest_lines(lake: str, base: str) -> list[dict[str, Any]]:
    """Every object but UNLISTED; FAILED with a failure-reason; a GHOST, a FOLDER and a HIDDEN line;
    a line outside the lake; an identical repeat of one line."""
    lines = []
    for key, i in sorted(OBJECTS.items()):
        if key == UNLISTED:
            continue
        if key == FAILED:
            lines.append(
                {
                    "source-ref": f"{lake}/{key}",
                    f"{ATTR}-metadata": {"failure-reason": "ClientError: worker did not answer"},
                }
            )
        else:
            lines.append(_line(f"{lake}/{key}", i))
    lines.insert(7, _line(f"{lake}/{GHOST}", 1))
    lines.insert(12, _line(f"{lake}/{FOLDER}", 0))
    lines.insert(15, _line(f"{lake}/{HIDDEN}", 0))
    lines.insert(3, _line(f"{base}/{OUTSIDE_KEY}", 2))
    lines.append(dict(lines[10]))
    return lines


def _write(uri: str, data: bytes) -> str:
    storage.write_bytes_atomic(uri, data)
    return storage.normalize(uri)


def _write_manifest(uri: str, lines: list[dict[str, Any]]) -> str:
    return _write(uri, "".join(json.dumps(line) + "\n" for line in lines).encode())


def _lake(base: str) -> tuple[str, dict[str, bytes]]:
    lake = storage.join(base, "lake")
    data = {key: encode(make_image(i), "PNG") for key, i in OBJECTS.items()}
    for key, body in data.items():
        _write(storage.join(lake, key), body)
    _write(storage.join(base, OUTSIDE_KEY), data["img_001.png"])  # exists, but not under --input
    return lake, data


def _setup(base: str) -> tuple[str, str, dict[str, bytes]]:
    lake, data = _lake(base)
    manifest = _write_manifest(storage.join(base, "meta", "output.manifest"), _manifest_lines(lake, base))
    return lake, manifest, data


def _run(lake: str, manifest: str, out: str, engine: Any, **opts: Any) -> dict[str, Any]:
    opts.setdefault("rows_per_part", 8)
    opts.setdefault("split_method", "stratified")  # every class in every channel of a small lake
    cfg = ManifestConfig(
        input=lake,
        output=out,
        input_manifest=manifest,
        label_attribute=ATTR,
        split=SPLIT,
        seed=5,
        max_reject_fraction=0.1,
        engine=engine.name,
        **opts,
    )
    return manifest_job.run(cfg, engine)


def _check(out: str, summary: dict[str, Any], lake: str, manifest: str, data: dict[str, bytes]) -> None:
    """The manifest row by row against the test's own truth."""
    rows = {r["key"]: r for r in read_channel(out, "all").to_pylist()}
    expected_keys = sorted(k for k in OBJECTS if k != UNLISTED)
    assert sorted(rows) == expected_keys  # the manifest's objects, not a listing of the lake
    for key in expected_keys:
        r = rows[key]
        assert r["uri"] == f"{lake}/{key}"
        assert r["size"] == len(data[key]), key
        # S3: the ETag from the HEAD; a local file gets its MD5 when its header is read (not a reject's)
        read = lake.startswith("s3://") or key != FAILED
        store = storage.store_for(r["uri"])
        if isinstance(store, (GCSStore, AzureStore)):  # a generation, Azure's own ETag: as listed
            fs, path = storage.filesystem(r["uri"])
            assert r["etag"] == store.listed_etag(fs.info(path)), key
        else:
            assert r["etag"] == (hashlib.md5(data[key]).hexdigest() if read else None), key
        assert r["last_modified"] is not None, key
        if key == FAILED:
            assert (r["status"], r["label"], r["channel"]) == ("rejected", None, None)
            assert r["reason"] == (
                f"no label: the line has no {ATTR!r} in --input-manifest "
                "(failure-reason: ClientError: worker did not answer)"
            )
        else:
            assert (r["status"], r["label"], r["format"]) == ("ok", _class(OBJECTS[key]), "png"), key
            assert r["label_index"] == CLASSES.index(r["label"])  # sorted names -> 0..K-1
            assert r["channel"] in SPLIT
    assert summary["labels"] == {"cat": 0, "dog": 1, "fox": 2}
    assert summary["rejects_by_reason"] == {"no label": 1}
    assert summary["counts"]["listed"] == len(expected_keys)
    assert summary["label_depth"] is None
    assert (summary["counts"]["skipped"], summary["skipped_by_reason"]) == (1, {"hidden": 1})
    for channel in SPLIT:
        assert sorted(read_channel(out, channel)["key"].to_pylist()) == sorted(
            k for k, r in rows.items() if r["channel"] == channel
        )
    t = summary["labels_table"]
    assert (t["uri"], t["format"], t["label_attribute"]) == (manifest, "sagemaker-ground-truth", ATTR)
    assert (t["rows"], t["unlabelled"], t["missing_objects"], t["outside_input"], t["not_in_lake"]) == (
        28,
        1,
        2,
        1,
        3,
    )
    assert t["outside_input_examples"] == [f"{lake.rsplit('/', 1)[0]}/{OUTSIDE_KEY}"]
    assert GHOST in t["not_in_lake_examples"] and FOLDER in t["not_in_lake_examples"]


def test_ground_truth_manifest_local(tmp_path: Path, local_engine) -> None:
    lake, manifest, data = _setup(storage.normalize(str(tmp_path)))
    summary = _run(lake, manifest, str(tmp_path / "ds"), local_engine)
    _check(str(tmp_path / "ds"), summary, lake, manifest, data)
    assert summary["parts"] > 1  # several key buckets and byte ranges
    shard_job.run(
        ShardConfig(dataset=str(tmp_path / "ds"), engine="local", num_shards=1, image_size=16), local_engine
    )
    info = read_dataset_info(str(tmp_path / "ds"))
    assert sum(c.rows for c in info.channels.values()) == summary["counts"]["accepted"] == len(OBJECTS) - 2


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize(
    "engine",
    [
        "local_engine",
        pytest.param("spark_engine", marks=pytest.mark.spark),
        pytest.param("dask_engine", marks=pytest.mark.dask),
    ],
)
def test_ground_truth_manifest_on_s3(s3_bucket: str, engine: str, request: pytest.FixtureRequest) -> None:
    lake, manifest, data = _setup(s3_bucket)
    summary = _run(lake, manifest, f"{s3_bucket}/ds", request.getfixturevalue(engine))
    _check(f"{s3_bucket}/ds", summary, lake, manifest, data)


@pytest.mark.parametrize(
    "bucket",
    [
        pytest.param("gcs_bucket", marks=[pytest.mark.gcs, pytest.mark.slow]),
        pytest.param("az_container", marks=pytest.mark.azure),
    ],
)
def test_ground_truth_manifest_on_another_store(
    bucket: str, local_engine: Any, request: pytest.FixtureRequest
) -> None:
    """On GCS and Azure, whose ETags name no content: the manifest keeps the store's own."""
    root = request.getfixturevalue(bucket)
    lake, manifest, data = _setup(root)
    summary = _run(lake, manifest, f"{root}/ds", local_engine)
    _check(f"{root}/ds", summary, lake, manifest, data)


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_conflicting_labels_fail_before_any_image_is_read(
    tmp_path: Path, local_engine, where: str, request: pytest.FixtureRequest
) -> None:
    base = storage.normalize(str(tmp_path)) if where == "local" else request.getfixturevalue("s3_bucket")
    lake, _ = _lake(base)
    lines = [*_manifest_lines(lake, base), _line(f"{lake}/img_001.png", 2), _line(f"{lake}/img_002.png", 0)]
    manifest = _write_manifest(f"{base}/output.manifest", lines)
    out = f"{base}/ds"
    with pytest.raises(ManifestError, match=r"labels 2 key\(s\) in two different ways") as err:
        _run(lake, manifest, out, local_engine)
    assert "'img_001.png': dog, fox" in str(err.value) and "'img_002.png': cat, fox" in str(err.value)
    assert manifest in str(err.value)
    staged = f"{out}/_staging/manifest"
    assert storage.exists(f"{staged}/ground-truth/lines")
    assert not storage.exists(f"{staged}/inspected")  # the headers pass never ran
    assert not storage.exists(f"{out}/manifests")


def test_unsupported_line_past_the_checked_ones_fails_on_the_workers(tmp_path: Path, local_engine) -> None:
    """A multi-label line the driver's check did not reach fails the job before any image is
    read, naming the manifest, the line's byte offset and the value."""
    base = storage.normalize(str(tmp_path))
    lake, _ = _lake(base)
    lines = _manifest_lines(lake, base)
    lines += [
        lines[0]
    ] * CHECK_LINES  # identical repeats: fine, and they put the bad line past the checked ones
    bad = {
        "source-ref": f"{lake}/img_001.png",
        ATTR: [0, 2],
        f"{ATTR}-metadata": {
            "type": "groundtruth/image-classification-multilabel",
            "class-map": {"0": "cat"},
        },
    }
    text = "".join(json.dumps(line) + "\n" for line in lines)
    manifest = _write(f"{base}/output.manifest", (text + json.dumps(bad) + "\n").encode())
    with pytest.raises(
        ManifestError, match=rf"at byte {len(text.encode())}: 'animal' is \[0, 2\].*multi-label"
    ):
        _run(lake, manifest, f"{base}/ds", local_engine, rows_per_part=200)
    assert not storage.exists(f"{base}/ds/_staging/manifest/ground-truth/labelled")  # no object was read


@pytest.mark.parametrize("size", [1, 7, 40, 97, 10_000])
def test_byte_ranges_read_every_line_once(tmp_path: Path, size: int) -> None:
    text = b"".join(b"x" * (n % 13) + b"\n" for n in range(60)) + b"last line, no newline"
    uri = _write(str(tmp_path / "m.manifest"), text)
    got = [
        (offset, line)
        for a in range(0, len(text), size)
        for offset, line in _lines(uri, a, min(a + size, len(text)))
    ]
    want, pos = [], 0
    for line in text.split(b"\n"):
        want.append((pos, line))
        pos += len(line) + 1
    assert got == want


# -- the options and the manifest are checked before an engine starts -------------------------------------


def _cfg(tmp_path: Path, manifest: str | None, **opts: Any) -> ManifestConfig:
    lake = tmp_path / "lake"
    lake.mkdir(exist_ok=True)
    opts.setdefault("label_attribute", ATTR)
    return ManifestConfig(
        input=str(lake), output=str(tmp_path / "ds"), input_manifest=manifest, split=SPLIT, **opts
    )


def _good(tmp_path: Path, i: int = 1) -> dict[str, Any]:
    return _line(storage.normalize(str(tmp_path / "lake" / f"img_{i}.png")), i)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (None, "--input-manifest {uri} does not exist"),
        ([], "--input-manifest {uri} has no lines"),
        (["GOOD", "{oops"], "--input-manifest {uri}: line 2: not JSON"),
        (["GOOD", "GOOD", '["a"]'], "--input-manifest {uri}: line 3: not a JSON object"),
        (
            ["GOOD", {"source-ref": "lake/img_1.png", ATTR: "cat"}],
            "--input-manifest {uri}: line 2: source-ref is 'lake/img_1.png', not an s3:// (or file://) URI",
        ),
        (
            [
                "GOOD",
                {
                    "source-ref": "LAKE/img_2.png",
                    ATTR: [0, 1],
                    f"{ATTR}-metadata": {"class-map": {"0": "a", "1": "b"}},
                },
            ],
            "--input-manifest {uri}: line 2: 'animal' is [0, 1] (a list): multi-label classification is not supported",
        ),
        (
            [
                {
                    "source-ref": "LAKE/img_2.png",
                    ATTR: {"annotations": []},
                    f"{ATTR}-metadata": {"type": "groundtruth/object-detection"},
                }
            ],
            "line 1: 'animal' is {{'annotations': []}} (groundtruth/object-detection): not an image classification label",
        ),
        (
            [{"source-ref": "LAKE/img_2.png", ATTR: 3, f"{ATTR}-metadata": {}}],
            "line 1: 'animal' is 3 but animal-metadata gives no class-name for it",
        ),
        (
            [{"source-ref": "LAKE/img_2.png", "sport": 1, "sport-metadata": {"class-name": "golf"}}],
            "--label-attribute 'animal': none of the first 1 line(s) of --input-manifest {uri} has it (their label "
            "attributes: ['sport'])",
        ),
        (
            [{"source-ref": "s3://other/img_2.png", ATTR: "cat"}],
            "--input-manifest {uri}: none of the first 1 line(s) names an object under --input",
        ),
    ],
)
def test_bad_manifest_fails_before_the_engine(tmp_path: Path, lines: list[Any] | None, message: str) -> None:
    uri = storage.normalize(str(tmp_path / "output.manifest"))
    lake = storage.normalize(str(tmp_path / "lake"))
    if lines is not None:
        text = "".join(
            (
                json.dumps(_good(tmp_path))
                if line == "GOOD"
                else line
                if isinstance(line, str)
                else json.dumps(line).replace("LAKE", lake)
            )
            + "\n"
            for line in lines
        )
        _write(uri, text.encode())
    with pytest.raises(ManifestError) as err:
        check_manifest_inputs(_cfg(tmp_path, uri))
    assert message.format(uri=uri) in str(err.value)


def test_a_failed_line_counts_as_having_the_attribute(tmp_path: Path) -> None:
    uri = _write_manifest(
        str(tmp_path / "output.manifest"),
        [
            {
                "source-ref": storage.normalize(str(tmp_path / "lake" / "a.png")),
                f"{ATTR}-metadata": {"failure-reason": "x"},
            }
        ],
    )
    check_manifest_inputs(_cfg(tmp_path, uri))


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"labels": "labels.csv"}, "--input-manifest {uri} and --labels labels.csv cannot be combined"),
        ({"label_depth": 2}, "--input-manifest {uri} and --label-depth 2 cannot be combined"),
        (
            {"inventory": "s3://inv/manifest.json"},
            "--input-manifest {uri} and --inventory s3://inv/manifest.json cannot be combined",
        ),
        ({"label_attribute": None}, "--input-manifest {uri} needs --label-attribute"),
        (
            {"label_attribute": "animal-metadata"},
            "--label-attribute 'animal-metadata': give the label attribute itself",
        ),
    ],
)
def test_option_combinations(tmp_path: Path, opts: dict[str, Any], message: str) -> None:
    uri = _write_manifest(str(tmp_path / "output.manifest"), [_good(tmp_path)])
    with pytest.raises(ConfigError) as err:
        check_manifest_inputs(_cfg(tmp_path, uri, **opts))
    assert message.format(uri=uri) in str(err.value)
    check_manifest_inputs(_cfg(tmp_path, uri))  # the manifest alone is fine


def test_label_attribute_without_input_manifest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--label-attribute 'animal' is only for --input-manifest"):
        check_manifest_inputs(_cfg(tmp_path, None))
    assert ManifestConfig(input="a", output="b").label_depth == 1  # path labels stay the default


def test_cli_with_the_shipped_conf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = storage.normalize(str(tmp_path))
    lake, manifest, _ = _setup(base)
    out = str(tmp_path / "ds")
    code = manifest_job.main(
        [
            "--conf",
            "conf/manifest.yaml",
            "--engine",
            "local",
            "--input",
            lake,
            "--output",
            out,
            "--input-manifest",
            manifest,
            "--label-attribute",
            ATTR,
            "--max-reject-fraction",
            "0.1",
            "--split-method",
            "stratified",
        ]
    )
    assert code == 0, capsys.readouterr().err
    marker = read_manifest_info(out)
    assert (
        marker.counts.accepted == len(OBJECTS) - 2
        and marker.labels_table
        and marker.labels_table.unlabelled == 1
    )
    code = manifest_job.main(
        ["--engine", "local", "--input", lake, "--output", out, "--input-manifest", manifest]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and err[-1].startswith("jobs/manifest.py: error: --input-manifest")
        and "--label-attribute" in err[-1]
    )


def test_base_with_the_same_ground_truth_manifest(tmp_path: Path, local_engine) -> None:
    """--base over a Ground Truth build: the same manifest is the same labels (the rebuild equals a
    scratch build and reads nothing again), and so is a copy of it at another URI (a new Ground
    Truth job's output path): labels are compared, not where they live (issue 35)."""
    lake, manifest, data = _setup(storage.normalize(str(tmp_path)))
    base = str(tmp_path / "v1")
    _run(lake, manifest, base, local_engine)
    summary = _run(lake, manifest, str(tmp_path / "v2"), local_engine, base=base)
    _check(str(tmp_path / "v2"), summary, lake, manifest, data)
    assert_same_tables(base, str(tmp_path / "v2"))
    assert summary["base"]["new"] == summary["base"]["changed"] == summary["base"]["left"] == 0
    listed = [k for k in OBJECTS if k != UNLISTED]
    assert summary["base"]["unchanged"] == len(listed)
    # every listed object but the failed line's, which v1 rejected without reading it
    assert summary["base"]["reused"] == len([k for k in listed if k != FAILED])
    other = _write(storage.join(str(tmp_path), "meta", "relabelled.manifest"), storage.read_bytes(manifest))
    summary = _run(lake, other, str(tmp_path / "v3"), local_engine, base=base)
    _run(lake, other, str(tmp_path / "v4"), local_engine)
    assert_same_tables(str(tmp_path / "v3"), str(tmp_path / "v4"))
    assert (summary["base"]["relabelled"], summary["base"]["reused"]) == (0, len(listed) - 1)
