"""pyproject.toml's metadata: the license, Triton only where it runs, httpx at run time."""
from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_license_is_apache_2_with_its_full_text():
    project = _project()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability" in text


def test_triton_only_on_linux_x86_64_and_httpx_at_run_time():
    deps = _project()["dependencies"]
    triton = [d for d in deps if d.startswith("triton")]
    assert len(triton) == 1
    assert "platform_system == 'Linux'" in triton[0] and "platform_machine == 'x86_64'" in triton[0]
    assert "httpx" in [d.split(";")[0].split(">")[0].split("=")[0].strip() for d in deps]  # moe bench serve
