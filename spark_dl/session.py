"""SparkSession from a named profile in ``conf/spark/``.

A profile is a ``spark-defaults``-style file (``key  value`` per line, ``#`` comments), so the
same file works with ``spark-submit --properties-file conf/spark/<name>.conf``. Profiles are
looked up in, in order: ``conf_dir`` given to :func:`get_session`, ``$SPARK_DL_CONF_DIR``, the
repository's ``conf/spark`` (source checkouts and editable installs) and
``<prefix>/share/spark_dl/conf/spark`` (``pip install .``).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

from .compat import SPARK_VERSION
from .errors import ConfigError

__all__ = ["available_profiles", "get_session", "load_profile", "profile_dirs"]

DEFAULT_PROFILE = "local"


def profile_dirs(conf_dir: str | Path | None = None) -> list[Path]:
    """Directories searched for ``<profile>.conf``, first match wins."""
    dirs = []
    if conf_dir is not None:
        dirs.append(Path(conf_dir))
    if os.environ.get("SPARK_DL_CONF_DIR"):
        dirs.append(Path(os.environ["SPARK_DL_CONF_DIR"]))
    dirs.append(Path(__file__).resolve().parents[1] / "conf" / "spark")
    dirs.append(Path(sys.prefix) / "share" / "spark_dl" / "conf" / "spark")
    return dirs


def available_profiles(conf_dir: str | Path | None = None) -> list[str]:
    return sorted({p.stem for d in profile_dirs(conf_dir) if d.is_dir() for p in d.glob("*.conf")})


def parse_properties(text: str, where: str) -> dict[str, str]:
    """Parse ``spark-defaults``-style text; every key must be a ``spark.*`` property."""
    props = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s=:]+)\s*[=:\s]\s*(\S.*)$", line)
        if m is None:
            raise ConfigError(f"{where}:{lineno}: expected 'key value', got {raw!r}; "
                              f"write one Spark property and its value per line")
        key, value = m.group(1), m.group(2).strip()
        if not key.startswith("spark."):
            raise ConfigError(f"{where}:{lineno}: unknown key {key!r}: profiles hold Spark "
                              f"properties, which start with 'spark.'")
        props[key] = value
    return props


def load_profile(name: str, conf_dir: str | Path | None = None) -> dict[str, str]:
    """Read profile ``name`` (e.g. ``"local"``) or a path to a ``.conf`` file."""
    if name.endswith(".conf") or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"profile file {path} does not exist")
    else:
        found = [d / f"{name}.conf" for d in profile_dirs(conf_dir) if (d / f"{name}.conf").is_file()]
        if not found:
            raise ConfigError(
                f"unknown Spark profile {name!r}; available: {', '.join(available_profiles(conf_dir))}"
                f" (searched {', '.join(str(d) for d in profile_dirs(conf_dir))})")
        path = found[0]
    props = parse_properties(path.read_text(), str(path))
    for key, value in props.items():
        # Resource discovery scripts run on each executor; make them absolute paths.
        if key.endswith(".discoveryScript") and not os.path.isabs(value):
            props[key] = str((path.parent / value).resolve())
    return props


def _base_conf() -> dict[str, str]:
    # Executors' Python workers must run the driver's interpreter, which has torch.
    py = os.environ.get("PYSPARK_PYTHON", sys.executable)
    conf = {"spark.pyspark.python": py,
            "spark.pyspark.driver.python": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
            "spark.sql.execution.arrow.pyspark.enabled": "true",
            "spark.ui.showConsoleProgress": "false"}
    if SPARK_VERSION < (4, 0, 0):
        # pyspark 3.5: when a cancelled task (a fit's peers, once one task failed) ran two
        # Python stages, the monitor of the one that had finished kills its worker although
        # it went back to the idle pool: the next task given it fails with "Socket is closed".
        # Workers that are not reused cannot be handed on (each still forks from the daemon).
        conf["spark.python.worker.reuse"] = "false"
    return conf


def get_session(profile: str | None = None, *, master: str | None = None,
                conf: Mapping[str, str] | None = None, conf_dir: str | Path | None = None,
                log_level: str = "WARN", remote: str | None = None):
    """Build or reuse the SparkSession.

    ``profile=None`` keeps what ``spark-submit`` configured when run under it, and otherwise
    uses the ``local`` profile. ``master`` and ``conf`` override the profile. An already
    active session is reused (Spark allows one per driver): its static settings stay.

    ``remote``: a Spark Connect session instead (needs ``pyspark[connect]``):
    ``"sc://host:15002"`` connects to a running Connect server (the profile's runtime
    ``spark.sql.*`` settings are applied to the session); ``"local[N]"`` starts pyspark's own
    local Connect server in this process with the profile's settings.
    """
    if remote is not None:
        return _connect_session(remote, profile, conf, conf_dir)
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    # Under spark-submit the JVM started this Python process and holds the submitted settings.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if submitted:
        SparkContext._ensure_initialized()
    props = _base_conf()
    if profile is not None or not submitted:
        props.update(load_profile(profile or DEFAULT_PROFILE, conf_dir))
    if master:
        props["spark.master"] = master
    props.update(conf or {})
    if submitted and profile is None:
        # spark-submit's settings (properties file, --master, --conf) win over our defaults.
        given = dict(SparkConf().getAll())
        props = {k: v for k, v in props.items() if k not in given}
    if not submitted:
        # PySpark takes the executors' Python from $PYSPARK_PYTHON when it starts the
        # SparkContext (the builder's spark.pyspark.python alone is not enough).
        os.environ.setdefault("PYSPARK_PYTHON", props["spark.pyspark.python"])
    active = SparkSession.getActiveSession()
    if active is not None and "spark.master" in props and \
            active.sparkContext.master != props["spark.master"]:
        warnings.warn(f"a SparkSession on {active.sparkContext.master} is already running in "
                      f"this driver; reusing it instead of {props['spark.master']!r} (stop it "
                      f"first to switch profiles)", stacklevel=2)
    builder = SparkSession.builder
    for k, v in props.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    return spark


def _connect_session(remote: str, profile: str | None, conf, conf_dir):
    import importlib.util

    from pyspark.sql import SparkSession
    if importlib.util.find_spec("grpc_status") is None:    # pyspark's Connect client needs it
        raise ConfigError("remote= needs the Spark Connect client: pip install "
                          "'pyspark[connect]' (or the pyspark-client package)")
    props = {**_base_conf(), **load_profile(profile or DEFAULT_PROFILE, conf_dir),
             **(conf or {})}
    os.environ.setdefault("PYSPARK_PYTHON", props["spark.pyspark.python"])
    jars = props.get("spark.jars.packages", "") + props.get("spark.jars", "")
    if not remote.startswith("sc://") and SPARK_VERSION < (4, 0, 0) and "spark-connect" not in jars:
        import pyspark
        raise ConfigError(
            f"remote={remote!r} starts pyspark's own Spark Connect server, which needs Spark "
            f"4.0 or newer; this is pyspark {pyspark.__version__}, which ships no server: "
            f"connect to a running one (remote='sc://host:15002'), or add it with conf="
            f"{{'spark.jars.packages': 'org.apache.spark:spark-connect_2.12:"
            f"{pyspark.__version__}'}} (fetched from Maven)")
    builder = SparkSession.builder.remote(remote)
    if remote.startswith("sc://"):       # a running server: runtime settings only
        props = {k: v for k, v in props.items() if k.startswith("spark.sql.")}
    else:
        props.pop("spark.master", None)  # the URL's
    for k, v in props.items():
        builder = builder.config(k, v)
    import warnings
    with warnings.catch_warnings():       # the local server took the static settings at its
        warnings.filterwarnings("ignore", message="Failed to set")   # start; not at runtime
        return builder.getOrCreate()
