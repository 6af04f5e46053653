"""The driver JVM the Spark engine starts itself (``python -m jobs.build --engine spark``): its
JIT's first tier only (``spark.driver.defaultJavaOptions``), the user's own JVM options after it
so that theirs win, and nothing of ours where ``spark-submit`` started the JVM or
``spark-defaults.conf`` sets default options; and its stop, which does not wait on PySpark's
accumulator server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_JVM_ARGUMENTS = """
import sys
sys.path.insert(0, sys.argv[1])
from jobs.common.engines.spark_engine import SparkEngine

engine = SparkEngine(master="local[1]")
bean = engine.spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
print("JVM:", *[a for a in bean.getInputArguments() if a.startswith("-XX:TieredStopAtLevel")])
engine.close()
"""

_STOP = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
from jobs.common.engines.spark_engine import SparkEngine

stops = []
for n in (1, 2):  # the second session starts while the first one's server may still be stopping
    before = set(threading.enumerate())
    engine = SparkEngine(master="local[1]")
    assert engine.map_partitions(lambda part: [sum(part)], list(range(10)), partitions=2) == [10, 35]
    server = engine.sc._accumulatorServer
    assert isinstance(server.server_address, str), "a Unix socket, as the engine asks of a local master"
    serving = [t for t in threading.enumerate() if t not in before and t.name.endswith("(serve_forever)")]
    stopped_on = []
    shutdown = server.shutdown
    server.shutdown = lambda: (stopped_on.append(threading.current_thread().name), shutdown())
    engine.close()
    stops.append((n, serving, not os.path.exists(server.server_address), stopped_on))
for n, serving, gone, stopped_on in stops:
    for t in serving:
        t.join(30)
    print("STOP:", n, len(serving), gone, *stopped_on, *(t.is_alive() for t in serving))
"""

_LAUNCH_CONF = """
import sys
sys.path.insert(0, sys.argv[1])
import logging
from jobs.common.engines.spark_engine import _launch_conf

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG: %(message)s")
conf = _launch_conf()
print("CONF:", conf and conf.get("spark.driver.defaultJavaOptions"))
"""


def _run(script: str, tag: str, **env: str) -> str:
    return _stdout(script, **env).rsplit(tag, 1)[1].strip()


def _stdout(script: str, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(REPO)],
        # No class archive (design/0048) a user may have made: these options alone.
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "LAKESHARD_SPARK_CDS": "off", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.spark
def test_the_driver_jvm_runs_the_first_jit_tier_and_the_users_own_options_come_after() -> None:
    user = "--driver-java-options -XX:TieredStopAtLevel=4 pyspark-shell"
    assert _run(_JVM_ARGUMENTS, "JVM:", PYSPARK_SUBMIT_ARGS=user).split() == [
        "-XX:TieredStopAtLevel=1",  # ours, from spark.driver.defaultJavaOptions
        "-XX:TieredStopAtLevel=4",  # the user's, later: the one the JVM keeps
    ]


def test_no_option_of_ours_where_spark_defaults_sets_default_options(tmp_path: Path) -> None:
    assert _run(_LAUNCH_CONF, "CONF:", SPARK_CONF_DIR=str(tmp_path)) == "-XX:TieredStopAtLevel=1"
    (tmp_path / "spark-defaults.conf").write_text(
        "# site settings\nspark.driver.memory 2g\nspark.driver.defaultJavaOptions -Xss4m\n"
    )
    out = _stdout(_LAUNCH_CONF, SPARK_CONF_DIR=str(tmp_path))
    assert out.rsplit("CONF:", 1)[1].strip() == "None"
    # and the job's log says so, with the options to add there
    assert (
        f"LOG: {tmp_path / 'spark-defaults.conf'} sets spark.driver.defaultJavaOptions: Spark's driver JVM "
        "starts with those options, not the engine's (-XX:TieredStopAtLevel=1); add them there to use them"
    ) in out.splitlines(), out


def test_no_option_of_ours_where_spark_submit_started_the_jvm() -> None:
    assert _run(_LAUNCH_CONF, "CONF:", PYSPARK_GATEWAY_PORT="1", PYSPARK_GATEWAY_SECRET="x") == "None"


@pytest.mark.spark
def test_the_stop_leaves_pysparks_accumulator_server_to_a_thread_of_its_own() -> None:
    # PySpark's SparkContext.stop waits for its accumulator server, whose handler polls once a
    # second; the engine stops it on a thread instead. Its
    # Unix socket's file is gone when close() returns, its serving thread ends, and a new
    # session starts meanwhile.
    lines = [line.split()[1:] for line in _stdout(_STOP).splitlines() if line.startswith("STOP:")]
    assert lines == [[str(n), "1", "True", "lakeshard-spark-accumulator-stop", "False"] for n in (1, 2)]
