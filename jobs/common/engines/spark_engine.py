"""The Spark engine: ``spark-submit`` (local or a cluster) or plain Python (local mode).

The jobs need one operation, ``map_partitions``: an RDD of work items, one partition per task,
each task's small result collected. Images never travel through Spark: a task reads them from
the lake and writes them to their shard file itself, so there is no JVM<->Python serialisation
of image bytes, no shuffle and no cache of them.

The stores' settings: on a local master (``local[N]``, ``local-cluster[...]``: the Python workers
run on this machine, as this user, like the local engine's processes) each task runs in the
driver's store environment as it is when the map starts (:func:`~jobs.common.engines.store_environ`,
credentials included), not the one the JVM started with: a session started before the store's
settings were set (a notebook, a test session) reads the same store the driver does. On a
cluster each executor keeps its own credentials and is told only where the stores are
(:data:`~jobs.common.engines.FORWARDED_ENV`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from jobs.common.engines import FORWARDED_ENV, STORE_ENV_PREFIXES, store_environ
from jobs.common.engines.jvm_archive import archive_options, driver_options, spark_would_split, switched_off
from lakeshard import errors

__all__ = ["SparkEngine", "archive_unused_because", "defaults_setting_java_options"]

log = logging.getLogger(__name__)

#: The last line of a Python traceback for one of our errors, as Spark passes it on (as text).
_TASK_ERROR = re.compile(r"^lakeshard\.errors\.(\w+): (.+)$", re.MULTILINE)

#: Spark 4.1's switch between the executor and its Python workers: Unix sockets instead of TCP.
_UNIX_SOCKETS = "spark.python.unix.domain.socket.enabled"


#: The driver JVM's options when the engine starts that JVM itself (``python -m jobs.build
#: --engine spark``; ``spark-submit`` starts its own): the JIT's first tier only. The driver
#: only schedules tasks and passes their small results (images never cross the JVM), so C2's
#: faster code gains nothing, while its compiler threads use the cores the Python workers
#: preprocess on (design/0047; figures in docs/performance.md).
_DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"
_DEFAULT_JAVA_OPTIONS = "spark.driver.defaultJavaOptions"


def _stop_in_background(server: Any) -> None:
    """``server.shutdown()`` (a PySpark accumulator server) on a daemon thread; a Unix socket's
    file removed first (``shutdown`` would remove it once its handler's poll ends)."""
    address = server.server_address
    if isinstance(address, str):  # a Unix socket's path; TCP's is (host, port)
        with contextlib.suppress(FileNotFoundError):
            os.remove(address)
    threading.Thread(target=server.shutdown, name="lakeshard-spark-accumulator-stop", daemon=True).start()


def _launch_conf() -> Any:
    """The ``SparkConf`` to start the driver JVM with, or None: ``spark.driver.defaultJavaOptions``
    (which Spark puts before the user's ``extraJavaOptions`` and ``--driver-java-options``, so a
    flag given there wins) set to :data:`_DRIVER_JAVA_OPTIONS` and, if ``python -m
    jobs.spark_cds`` made one, this install's class archive (design/0048), unless a JVM is already running
    (``spark-submit``, or an earlier session of this process) or ``spark-defaults.conf`` sets its
    own (``PYSPARK_SUBMIT_ARGS`` comes after it, and replaces it, by itself)."""
    from pyspark import SparkConf, SparkContext

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return None
    options = " ".join(filter(None, [_DRIVER_JAVA_OPTIONS, driver_options()]))
    defaults = defaults_setting_java_options()
    if defaults is not None:
        log.info(
            "%s sets %s: Spark's driver JVM starts with those options, not the engine's (%s); "
            "add them there to use them",
            defaults,
            _DEFAULT_JAVA_OPTIONS,
            options,
        )
        return None
    log.info(
        "starting Spark's driver JVM with %s=%s (its JIT's first tier only%s; options of yours come after)",
        _DEFAULT_JAVA_OPTIONS,
        options,
        ", this install's class archive" if options != _DRIVER_JAVA_OPTIONS else "",
    )
    return SparkConf(loadDefaults=False).set(_DEFAULT_JAVA_OPTIONS, options)


def defaults_setting_java_options() -> str | None:
    """The ``spark-defaults.conf`` (``$SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``) that sets
    ``spark.driver.defaultJavaOptions``, which the engine then leaves alone; None if none does."""
    from pyspark.find_spark_home import _find_spark_home

    folder = os.environ.get("SPARK_CONF_DIR") or os.path.join(_find_spark_home(), "conf")
    path = os.path.join(folder, "spark-defaults.conf")
    try:
        with open(path) as f:
            keys = {
                line.split(None, 1)[0] for line in f if line.strip() and not line.lstrip().startswith("#")
            }
    except OSError:
        return None
    return path if _DEFAULT_JAVA_OPTIONS in keys else None


def archive_unused_because(path: Path) -> str | None:
    """Why the driver JVM the engine starts would not map the archive ``path`` even when it is
    made (``python -m jobs.spark_cds --check``), or None."""
    if switched_off():
        return "LAKESHARD_SPARK_CDS=off starts the driver JVM without it"
    if spark_would_split(path):
        return "its path has a space or a quote, at which Spark splits JVM options"
    defaults = defaults_setting_java_options()
    if defaults is not None:
        return (
            f"{defaults} sets {_DEFAULT_JAVA_OPTIONS}, which the engine leaves alone: "
            f"add `{archive_options(path)}` there to use it"
        )
    return None


def _unix_sockets() -> bool:
    """Whether this PySpark can reach its Python workers over Unix sockets (Spark 4.1 and later,
    on a system that has them)."""
    import pyspark

    major, minor = (int(x) for x in re.findall(r"\d+", pyspark.__version__)[:2])
    return hasattr(socket, "AF_UNIX") and (major, minor) >= (4, 1)


def _task_error(exc: BaseException) -> errors.PlatformError | None:
    """The error a task raised on purpose (a :class:`~lakeshard.errors.PlatformError`), rebuilt from
    the text of the Spark exception that carries its traceback; ``None`` for anything else.

    Dask re-raises a task's own exception on the client; Spark gives a ``PythonException`` (or a
    ``Py4JJavaError``) whose message holds the worker's traceback. Rebuilding the error lets the
    CLI print ``error: cannot read s3://...`` instead of pages of JVM stack.
    """
    found = _TASK_ERROR.findall(str(exc))
    if not found:
        return None
    name, message = found[-1]
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.PlatformError)):
        return None
    return cls(message)


def _in_store_environ(
    env: dict[str, str], fn: Callable[[list[Any]], list[Any]], part: list[Any]
) -> list[Any]:
    """``fn(part)`` in a Python worker whose store variables are ``env`` (the driver's, at the
    map): those the driver lacks are removed; the rest of the worker's environment (Spark's own)
    is kept."""
    for name in [k for k in os.environ if k.startswith(STORE_ENV_PREFIXES) and k not in env]:
        del os.environ[name]
    os.environ.update(env)
    return fn(part)


class SparkEngine:
    name = "spark"

    def __init__(
        self, *, spark: Any = None, master: str | None = None, app_name: str = "lakeshard", **_: Any
    ) -> None:
        from pyspark import SparkConf, SparkContext
        from pyspark.sql import SparkSession

        self._owned = spark is None
        if spark is None:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            # Workers run the driver's interpreter (the one with this package installed)
            # unless the user chose another; on a cluster, set PYSPARK_PYTHON to the workers' path.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            builder = SparkSession.builder.master(master) if master else SparkSession.builder
            # The JVM, so SparkConf() sees spark-submit's --master and --conf.
            SparkContext._ensure_initialized(conf=_launch_conf())
            given = SparkConf()
            local = (master or given.get("spark.master", "local[*]")).startswith("local")
            same_python = os.environ["PYSPARK_PYTHON"] == sys.executable
            if local and same_python and not given.contains("spark.python.daemon.module"):
                # Local workers run this interpreter, which has this package: skip the 0.2-0.5 s
                # each task spends re-reading Spark's archives (see jobs.common.engines.spark_daemon).
                # On a cluster, pass this --conf if the workers have the package installed.
                builder = builder.config("spark.python.daemon.module", "jobs.common.engines.spark_daemon")
            if local and _unix_sockets() and not given.contains(_UNIX_SOCKETS):
                # The executor talks to its Python workers over Unix sockets, not TCP on
                # 127.0.0.1: a task's small messages wait on no TCP acknowledgement
                # (design/0030). On a cluster, pass this --conf.
                builder = builder.config(_UNIX_SOCKETS, "true")
            spark = (
                builder.appName(app_name)
                .config("spark.sql.session.timeZone", "UTC")
                # Stage progress on a terminal; in a log file its redrawn bar is a flood.
                .config("spark.ui.showConsoleProgress", "true" if sys.stderr.isatty() else "false")
                .getOrCreate()
            )
            spark.sparkContext.setLogLevel("WARN")
        self.spark = spark
        self.sc = spark.sparkContext
        conf = self.sc.getConf()
        log.info(
            "Spark %s, master %s, Python workers started by %s, reached over %s",
            spark.version,
            self.sc.master,
            conf.get("spark.python.daemon.module", "pyspark.daemon"),
            "Unix sockets" if conf.get(_UNIX_SOCKETS, "false").lower() == "true" else "TCP",
        )
        # Where the stores are (not who: on a cluster, credentials stay with each executor's own
        # environment; a local master's tasks get the driver's, see the module doc).
        self._local = self.sc.master.startswith("local")
        for name in FORWARDED_ENV:
            if os.environ.get(name):
                self.sc.environment[name] = os.environ[name]

    @property
    def parallelism(self) -> int:
        return max(1, self.sc.defaultParallelism)

    @property
    def task_cpus(self) -> int:
        return max(1, int(self.sc.getConf().get("spark.task.cpus", "1")))

    def map_partitions(
        self,
        fn: Callable[[list[Any]], list[Any]],
        items: Sequence[Any],
        *,
        partitions: int,
        cpu_bound: bool = False,
    ) -> list[Any]:
        if not items:
            return []
        rdd = self.sc.parallelize(list(items), max(1, min(partitions, len(items))))
        if self._local:
            fn = partial(_in_store_environ, store_environ(), fn)
        try:
            return rdd.mapPartitions(lambda it: fn(list(it))).collect()
        except Exception as exc:
            ours = _task_error(exc)
            if ours is None:
                raise
            raise ours from exc

    def close(self) -> None:
        """Stop the session the engine started (not one it was handed), without waiting on
        PySpark's accumulator server: ``SparkContext.stop`` waits for it, and its handler polls
        its connection once a second (docs/performance.md, "Spark's stop"). The server is
        stopped on a thread of its own instead, which ends within a second; its Unix socket's
        file is removed now, since this process may exit before that thread ends."""
        if not self._owned:
            return
        server = getattr(self.sc, "_accumulatorServer", None)
        if server is not None:
            self.sc._accumulatorServer = None  # stop() then leaves it alone
        try:
            self.spark.stop()
        finally:
            if server is not None:
                _stop_in_background(server)
