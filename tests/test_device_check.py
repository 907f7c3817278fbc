"""The prepared device check (scripts/device-check) and the wheels it carries (scripts/device-wheels).

* The wheel list covers every runtime dependency the device image lacks: the closure of pyproject.toml's
  dependencies (their extras and environment markers for the device's Python 3.12 on Linux x86_64, read
  from the installed packages' metadata), descending only through packages the image does not have (its
  own packages bring their own dependencies), and it pins the versions installed here.
* The listed wheels stay under the 40 MiB the device call can carry beside the working tree.
* `scripts/device-check --cpu --tiny` runs every step, in seconds, and writes its results.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DEVICE_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
}  # fmt: skip


def _names(path: Path) -> list[str]:
    return [
        line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()
    ]


def _image() -> set[str]:
    return {
        canonicalize_name(line.split("==")[0]) for line in _names(ROOT / "scripts/device-image-packages.txt")
    }


def _wheels() -> dict[str, tuple[str, int]]:
    out = {}
    for line in (ROOT / "scripts/device-wheels.txt").read_text().splitlines():
        match = re.match(r"([\w.-]+)==(\S+)\s*#\s*(\d+) bytes", line)
        if match:
            out[canonicalize_name(match.group(1))] = (match.group(2), int(match.group(3)))
    return out


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**DEVICE_ENV, "extra": extra}) for extra in extras | {""})


def _requirements(dist: md.Distribution, extras: set[str]) -> list[Requirement]:
    """What `dist` with `extras` requires on the device (an extra may name further extras of its own)."""
    name = canonicalize_name(dist.metadata["Name"])
    reqs = [Requirement(line) for line in dist.requires or []]
    grown = True
    while grown:
        grown = False
        for req in reqs:
            if (
                canonicalize_name(req.name) == name
                and _applies(req, extras)
                and not set(req.extras) <= extras
            ):
                extras, grown = extras | set(req.extras), True
    return [r for r in reqs if canonicalize_name(r.name) != name and _applies(r, extras)]


def missing_on_the_device() -> dict[str, str]:
    """Every distribution Mula needs at run time that the device image lacks, with its version here."""
    image = _image()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(d) for d in dependencies]
    todo = [r for r in todo if _applies(r, set())]
    missing: dict[str, str] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in image or name in missing:
            continue
        dist = md.distribution(req.name)
        missing[name] = dist.version
        todo += _requirements(dist, set(req.extras))
    return missing


def test_the_wheels_cover_every_runtime_dependency_missing_from_the_device_image() -> None:
    missing, wheels = missing_on_the_device(), _wheels()
    assert {"litdata", "jsonargparse", "zstandard"} <= set(
        missing
    )  # the issue's own list, less wandb (an extra)
    uncovered = sorted(set(missing) - set(wheels))
    assert not uncovered, (
        f"runtime dependencies neither in the device image nor in scripts/device-wheels.txt: {uncovered}"
    )
    assert not sorted(set(wheels) - set(missing)), (
        "scripts/device-wheels.txt carries what the device does not need"
    )
    for name, (version, _) in wheels.items():
        assert version == missing[name], (
            f"{name}: the wheel pins {version}, this repository runs {missing[name]}"
        )


def test_the_wheels_stay_under_40_mib() -> None:
    assert sum(size for _, size in _wheels().values()) < 40 * 2**20


def test_device_check_cpu_tiny_runs_every_step(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/device-check"), "--cpu", "--tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    statuses = {name: step["status"] for name, step in results["steps"].items()}
    assert done.returncode == 0 and set(statuses.values()) == {"ok"}, (statuses, done.stdout[-3000:])
    steps = results["steps"]
    assert steps["env"]["details"]["modules"] > 100 and not steps["env"]["details"]["import_failures"]
    assert "passed" in steps["kernels"]["details"]["summary"]
    assert steps["moe_layer"]["details"]["tables"][0]["rows"]
    assert [run["label"] for run in steps["bench"]["details"]["runs"]] == [
        "tiny MoE",
        "tiny dense",
        "tiny MoE, offload",
    ]
    assert all(run["result"]["tokens_per_s_per_device"] > 0 for run in steps["bench"]["details"]["runs"])
    assert steps["fit"]["details"]["steps"] == 4
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "check.log").is_file()
