"""The version-1 checkpoints kept under tests/data/v1 and the script that made them
(``data/make_v1_fixture.py``: their tensors and layouts), for the tests that read them."""
import importlib.util
import pathlib

DATA = pathlib.Path(__file__).parent / "data"
_spec = importlib.util.spec_from_file_location("make_v1_fixture", DATA / "make_v1_fixture.py")
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)
