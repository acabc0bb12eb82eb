"""What the wheel holds, checked from the source tree in a second (``python3 dev.py
test-wheel`` builds and installs the real one): every data file under ``src/`` is package data,
each package is marked typed and reports the distribution's version, the licence file is the
declared one, and the README's FSDP2 example is the demo that test-wheel runs."""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = sorted(p.parent.name for p in (ROOT / "src").glob("*/__init__.py"))
NOT_PACKAGE_DATA = {"flexshard/README.md"}  # the package boundary, for readers of the repository


def _source_files(package: str) -> set[str]:
    return {str(f.relative_to(ROOT / "src")) for f in (ROOT / "src" / package).rglob("*")
            if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts}


def _package_data(package: str) -> set[str]:
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]
    return {str(f.relative_to(ROOT / "src")) for pattern in [*globs.get("*", []), *globs.get(package, [])]
            for f in (ROOT / "src" / package).glob(pattern) if f.is_file()}


def test_the_packages_are_found():
    assert PACKAGES == ["flexckpt", "flexckpt_accelerate", "flexckpt_hf", "flexckpt_lightning", "flexckpt_torchtitan",
                        "flexshard", "flextrain", "zephon_state"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_data_file_of_a_package_ships_in_the_wheel(package):
    assert _source_files(package) - NOT_PACKAGE_DATA == _package_data(package), (
        "a data file under src/ that the wheel would leave out: add it to [tool.setuptools.package-data]")
    assert f"{package}/py.typed" in _package_data(package)


def test_the_trainers_presets_read_corpora_that_ship_in_the_wheel():
    from flextrain.config import DataConfig

    shipped = _package_data("flextrain")
    for path in DataConfig().sources.values():
        assert str(Path(path).relative_to(ROOT / "src")) in shipped, path


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "flexckpt_torchtitan"])  # that one: test-wheel
def test_each_package_reports_the_distributions_version(package):
    version = PYPROJECT["project"]["version"]
    assert importlib.metadata.version("flexckpt") == version, "the venv's install is stale: python3 dev.py test"
    assert importlib.import_module(package).__version__ == version


def test_the_licence_file_is_the_declared_one():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License\n                           Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    assert all((ROOT / f).is_file() for f in project["license-files"]), project["license-files"]
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]  # the first to read an SPDX string


def test_the_readme_shows_the_fsdp2_example_that_test_wheel_runs():
    example = (ROOT / "demos" / "fsdp2_quickstart.py").read_text()
    assert f"```python\n{example}```" in (ROOT / "README.md").read_text()


def test_an_s3_url_without_the_s3_extra_names_it(monkeypatch):
    from fsspec.registry import _registry as loaded_filesystems

    from flexckpt.storage import Storage
    from zephon_state import ConfigError
    from zephon_state.storage import IoOptions, expand

    monkeypatch.setitem(sys.modules, "s3fs", None)  # as where `pip install flexckpt` left it out
    monkeypatch.delitem(loaded_filesystems, "s3", raising=False)
    with pytest.raises(ImportError, match=r"^checkpoint location 's3://bucket/run': .*s3fs.* \(s3://: pip install "
                                          r"'flexckpt\[s3\]'\)$"):
        Storage("s3://bucket/run")
    with pytest.raises(ConfigError, match=r"^source 's3://bucket/a.jsonl': .*s3fs.*'flexckpt\[s3\]'\)$"):
        expand("s3://bucket/a.jsonl", IoOptions())


@pytest.mark.parametrize("package, framework, extra", [
    ("flexckpt_lightning", "lightning", "lightning"), ("flexckpt_accelerate", "accelerate", "accelerate"),
    ("flexckpt_hf", "transformers", "hf"), ("flexckpt_torchtitan", "torchtitan", "torchtitan")])
def test_an_integration_without_its_extra_names_the_extra_in_one_line(monkeypatch, package, framework, extra):
    monkeypatch.setitem(sys.modules, framework, None)  # as where `pip install flexckpt` left it out
    monkeypatch.delitem(sys.modules, package, raising=False)
    with pytest.raises(ModuleNotFoundError) as e:
        importlib.import_module(package)
    assert str(e.value).startswith(f"{package} needs {framework}, which is not installed: "
                            f"pip install 'flexckpt[{extra}]'")
    assert e.value.name == framework


def test_the_pins_dev_py_installs_satisfy_every_bound_in_pyproject():
    from packaging.requirements import Requirement

    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    project = PYPROJECT["project"]
    for text in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        req = Requirement(text)
        pin = pins.get(req.name)
        if pin is not None and req.specifier:
            assert req.specifier.contains(pin, prereleases=True), f"constraints.txt pins {req.name}=={pin}, outside {text!r}"
