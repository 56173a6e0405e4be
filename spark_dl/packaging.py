"""Ship spark_dl and its Python environment to a cluster whose nodes do not have them.

    python -m spark_dl.packaging build/ship
    spark-submit --master spark://HOST:7077 \\
        --archives build/ship/env.tar.gz#environment \\
        --py-files build/ship/spark_dl.zip \\
        --conf spark.pyspark.python=./environment/bin/python \\
        --conf spark.pyspark.driver.python="$(which python)" \\
        jobs/demo.py --config conf/jobs/demo.toml

``env.tar.gz`` is a virtual environment with the driver's exact versions of spark_dl's native
dependencies (torch, numpy, pandas, pyarrow, Pillow), packed with venv-pack; Spark unpacks it
into every executor's working directory as ``./environment``, and the executors' Python workers
run its interpreter. ``spark_dl.zip`` is the package itself (pure Python), put on the workers'
``sys.path`` by ``--py-files``, so a change to spark_dl ships without rebuilding the environment.

venv-pack keeps the environment's link to its base interpreter: the same Python must exist at
the same path on every node (the usual case for one image per cluster). Where it does not,
pack a conda environment with conda-pack instead and pass that archive to ``--archives``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

__all__ = ["RUNTIME", "build_env", "main", "pack_env", "runtime_requirements", "zip_package"]

RUNTIME = ("torch", "numpy", "pandas", "pyarrow", "pillow")   # what executors import


def runtime_requirements(extra: tuple[str, ...] = ()) -> list[str]:
    """Pins of the driver's own versions: executors must run the code the driver pickled."""
    pins = []
    for name in RUNTIME:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"{name} is not installed in this interpreter ({sys.executable});"
                               f" run packaging from the environment that runs the driver") \
                from None
    return pins + list(extra)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(map(str, cmd))}):\n{proc.stderr[-3000:]}")


def build_env(env_dir: str | Path, requirements: list[str]) -> Path:
    """A new virtual environment at ``env_dir`` with ``requirements`` installed (pip)."""
    env_dir = Path(env_dir)
    if env_dir.exists():
        raise FileExistsError(f"{env_dir} exists; remove it or pick another folder")
    _run([sys.executable, "-m", "venv", str(env_dir)], "creating the virtual environment")
    _run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet",
          "--disable-pip-version-check", *requirements], "installing " + " ".join(requirements))
    return env_dir


def pack_env(env_dir: str | Path, out: str | Path, compress_level: int = 1) -> Path:
    """``env_dir`` packed by venv-pack into ``out`` (.tar.gz), written atomically."""
    try:
        import venv_pack
    except ImportError as e:
        raise RuntimeError("packing needs venv-pack: pip install 'spark_dl[pack]'") from e
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.tar.gz")
    venv_pack.pack(prefix=str(env_dir), output=str(tmp), compress_level=compress_level,
                   force=True, verbose=False)
    os.replace(tmp, out)
    return out


def zip_package(out: str | Path) -> Path:
    """The spark_dl package (sources, no caches) as a zip for ``--py-files``, atomically."""
    pkg = Path(__file__).resolve().parent
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(pkg.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                z.write(path, path.relative_to(pkg.parent).as_posix())
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark_dl.packaging", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for env.tar.gz and spark_dl.zip")
    ap.add_argument("--env", help="pack this existing virtual environment instead of building "
                                  "one (it must hold torch, numpy, pandas, pyarrow, Pillow)")
    ap.add_argument("--with", dest="extra", action="append", default=[],
                    help="one more requirement for the built environment (repeatable)")
    ap.add_argument("--compress-level", type=int, default=1, choices=range(10))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_dir = Path(args.env) if args.env else out / "env"
    if not args.env:
        if env_dir.exists():
            shutil.rmtree(env_dir)
        build_env(env_dir, runtime_requirements(tuple(args.extra)))
    archive = pack_env(env_dir, out / "env.tar.gz", args.compress_level)
    package = zip_package(out / "spark_dl.zip")
    print(f"{archive} ({archive.stat().st_size / 1e6:,.0f} MB) and {package}; submit with\n"
          f"  --archives {archive}#environment --py-files {package} \\\n"
          f"  --conf spark.pyspark.python=./environment/bin/python \\\n"
          f"  --conf spark.pyspark.driver.python={sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
