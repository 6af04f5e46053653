"""A class-data-sharing archive for the driver JVM the Spark engine starts itself: the classes
Spark loads to start a session and run its first tasks, parsed, verified and laid out once by
one JVM, then mapped by every later one instead of loaded again (design/0048).

    python -m jobs.spark_cds                       # once per Java and Spark install
    python -m jobs.build --engine spark ...        # then finds it and starts Spark sooner

An archive belongs to one Java and one Spark install: its name carries a digest of the ``java``
binary (``$JAVA_HOME/bin/java``, else the one on ``PATH``) and of Spark's jars, so an upgrade of
either makes the engine look for another name (and run without one until it is made). Archives
live in ``$LAKESHARD_SPARK_CDS_DIR``, else ``$XDG_CACHE_HOME/lakeshard/spark-cds``, else
``~/.cache/lakeshard/spark-cds``; ``LAKESHARD_SPARK_CDS=off`` starts the JVM without one.

An archive is made by a JVM that exits (``-XX:ArchiveClassesAtExit``), into a temporary file
renamed into place only once that JVM has exited cleanly and a second JVM has started Spark
with it under ``-Xshare:on`` (which fails rather than run without it): a JVM handed a cut or
damaged archive can crash, so the engine uses only an archive whose size is the one recorded
beside it when it was made. A JVM that cannot use an archive (another ``-cp`` first, other GC
options) starts without it; the engine silences the JVM's CDS messages (``-Xlog:cds*=off``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lakeshard.errors import ConfigError, EngineError

__all__ = [
    "Archive",
    "archive_dir",
    "archive_options",
    "archive_path",
    "driver_options",
    "is_whole",
    "make_archive",
    "required_archive_path",
    "spark_would_split",
    "switched_off",
    "usable_archive",
]

log = logging.getLogger(__name__)

_NO_JAVA = "no java: set JAVA_HOME or put java on PATH (Spark needs it too)"

#: Seconds each JVM of :func:`make_archive` may take (the recording one writes its archive at exit).
_TIMEOUT_S = 600

#: The probe both of :func:`make_archive`'s JVMs run: the engine's own start, one small map on
#: two Python workers (the executor's classes for them), its stop; the JVM then exits and waits
#: for nothing of Python's (``SparkContext._gateway.proc`` is the JVM, its stdin the pipe whose
#: end tells it to exit), so the archive is whole when this script ends.
_PROBE = """
import json, sys, time
from pyspark import SparkContext
from jobs.common.engines.spark_engine import SparkEngine
from jobs.common.engines.jvm_archive import probe_task

t0 = time.perf_counter()
engine = SparkEngine(master="local[2]", app_name="lakeshard-spark-cds")
t1 = time.perf_counter()
assert sorted(engine.map_partitions(probe_task, list(range(4)), partitions=2)) == [0, 2, 4, 6]
engine.close()
gateway = SparkContext._gateway
gateway.shutdown()
gateway.proc.stdin.close()
code = gateway.proc.wait(timeout=float(sys.argv[1]))
print("PROBE:" + json.dumps({"session_s": t1 - t0, "jvm_exit_code": code}))
"""


def probe_task(items: list[int]) -> list[int]:
    """The probe's task (importable by Spark's Python workers)."""
    return [2 * i for i in items]


def archive_dir() -> Path:
    """Where archives are kept (see the module doc)."""
    if os.environ.get("LAKESHARD_SPARK_CDS_DIR"):
        return Path(os.environ["LAKESHARD_SPARK_CDS_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lakeshard" / "spark-cds"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return Path(os.path.realpath(found)) if found and os.path.exists(found) else None


def _install() -> dict[str, Any] | None:
    """What an archive belongs to: the ``java`` binary and Spark's jars (paths, sizes, times);
    None without a ``java``."""
    import pyspark
    from pyspark.find_spark_home import _find_spark_home

    java = _java()
    if java is None:
        return None
    home = Path(os.path.realpath(_find_spark_home()))
    jars = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (home / "jars").glob("*.jar"))
    stat = java.stat()
    return {
        "java": [str(java), stat.st_size, stat.st_mtime_ns],
        "spark_home": str(home),
        "jars": hashlib.sha256(json.dumps(jars).encode()).hexdigest(),
        "pyspark": pyspark.__version__,
    }


def _path_of(install: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(install, sort_keys=True).encode()).hexdigest()[:16]
    return archive_dir() / f"spark-{install['pyspark']}-{digest}.jsa"


def archive_path() -> Path | None:
    """The archive of this Java and Spark install (made or not); None without a ``java``."""
    install = _install()
    return None if install is None else _path_of(install)


def required_archive_path() -> Path:
    """:func:`archive_path`, or :class:`ConfigError` without a ``java``."""
    path = archive_path()
    if path is None:
        raise ConfigError(_NO_JAVA)
    return path


def _record(path: Path) -> Path:
    return path.with_suffix(".json")


def is_whole(path: Path) -> bool:
    """Whether the archive ``path`` is there with the size recorded beside it when it was made."""
    try:
        return bool(path.stat().st_size == json.loads(_record(path).read_text())["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def usable_archive() -> Path | None:
    """This install's archive if it was made whole (:func:`is_whole`)."""
    path = archive_path()
    return path if path is not None and is_whole(path) else None


def spark_would_split(path: Path) -> bool:
    """Whether Spark would split ``path`` inside ``spark.driver.defaultJavaOptions``."""
    return any(c.isspace() or c in "\"'" for c in str(path))


def switched_off() -> bool:
    """Whether ``LAKESHARD_SPARK_CDS=off`` asks for a driver JVM without an archive."""
    return os.environ.get("LAKESHARD_SPARK_CDS", "").lower() == "off"


def archive_options(path: Path) -> str:
    """The driver JVM's options that map the archive ``path``, its CDS messages off."""
    return f"-Xlog:cds*=off -XX:SharedArchiveFile={path}"


def driver_options() -> str:
    """The driver JVM's options for this install's archive, or "" (none made, a path Spark
    would split at a space, or ``LAKESHARD_SPARK_CDS=off``)."""
    if switched_off():
        return ""
    path = usable_archive()
    if path is None:
        log.info(
            "Spark's driver JVM starts without a class archive: `python -m jobs.spark_cds` makes "
            "one once for this Java and Spark (design/0048)"
        )
        return ""
    if spark_would_split(path):
        log.info("not using the class archive %s: Spark splits JVM options at spaces", path)
        return ""
    return archive_options(path)


@dataclasses.dataclass(frozen=True, slots=True)
class Archive:
    """An archive :func:`make_archive` made (or found)."""

    path: Path
    size: int
    made: bool  #: False: it was there already
    session_s: float | None  #: Spark's start to a session with it (the check's JVM); None if found


def _run_probe(java_options: str, timeout: float) -> dict[str, Any]:
    """:data:`_PROBE` in a fresh interpreter whose driver JVM gets ``java_options``."""
    root = str(Path(__file__).resolve().parents[3])  # the folder holding the jobs package
    env = {
        **os.environ,
        "LAKESHARD_SPARK_CDS": "off",  # the engine's own archive options: not in these JVMs
        "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        "PYSPARK_SUBMIT_ARGS": f'--master local[2] --driver-java-options "{java_options}" pyspark-shell',
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, str(timeout)],
            env=env,
            capture_output=True,
            text=True,
            timeout=2 * timeout,
        )
    except subprocess.TimeoutExpired:
        raise EngineError(f"Spark's driver JVM did not start and stop within {2 * timeout:g} s") from None
    if proc.returncode != 0 or "PROBE:" not in proc.stdout:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise EngineError(
            f"starting Spark with {java_options!r} failed (exit code {proc.returncode}):\n{tail}"
        )
    result: dict[str, Any] = json.loads(proc.stdout.rsplit("PROBE:", 1)[1])
    if result["jvm_exit_code"] != 0:
        raise EngineError(
            f"Spark's driver JVM exited with code {result['jvm_exit_code']} writing its archive"
        )
    return result


def make_archive(*, force: bool = False, timeout: float = _TIMEOUT_S) -> Archive:
    """Make this install's archive (unless one is there, or ``force``): a training JVM writes
    it at exit into a temporary file, a second JVM must start Spark with it under
    ``-Xshare:on``, then it is renamed into place with its size recorded beside it.

    Raises:
        ConfigError: no ``java``, or the archive folder's path has a space.
        EngineError: a JVM failed (its last lines of stderr in the message)."""
    install = _install()
    if install is None:
        raise ConfigError(_NO_JAVA)
    path = _path_of(install)
    if spark_would_split(path):
        raise ConfigError(
            f"the archive folder {path.parent} has a space or a quote in its path, which Spark would "
            "split; set LAKESHARD_SPARK_CDS_DIR to a folder without one"
        )
    if is_whole(path) and not force:
        return Archive(path, path.stat().st_size, made=False, session_s=None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    tmp.unlink()  # the JVM writes it
    try:
        log.info("starting Spark once to record the classes it loads (its JVM writes them at exit)")
        _run_probe(f"-Xlog:cds*=off -XX:ArchiveClassesAtExit={tmp}", timeout)
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise EngineError(f"Spark's driver JVM exited without writing its archive {tmp}")
        log.info("starting Spark again with the archive (-Xshare:on: the JVM fails if it cannot map it)")
        checked = _run_probe(f"-Xshare:on -Xlog:cds*=off -XX:SharedArchiveFile={tmp}", timeout)
        size = tmp.stat().st_size
        record = {
            "size": size,
            "made": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "session_s": round(checked["session_s"], 2),
            **install,
        }
        _record(tmp).write_text(json.dumps(record, indent=1))
        os.replace(_record(tmp), _record(path))
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, _record(tmp)):
            leftover.unlink(missing_ok=True)
    return Archive(path, size, made=True, session_s=checked["session_s"])
