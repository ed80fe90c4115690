"""Static checks of the image recipes (the build + smoke run in images/build.sh, CI's last step)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml

from shipping import CHART, ROOT

IMAGES = ("runtime", "operator")


def dockerfile(image: str) -> str:
    return (ROOT / "images" / image / "Dockerfile").read_text()


def wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "images" / "wheelhouse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_offline_nonroot_readonly_ready(image: str) -> None:
    text = dockerfile(image)
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and "FROM ${BASE_IMAGE}" in text
    installs = re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text)
    assert installs and all("--no-index" in i for i in installs), installs  # never reaches an index
    uid = re.search(r"^ARG UID=(\d+)$", text, re.M).group(1)
    assert int(uid) > 0 and re.search(r"^USER \$\{UID\}:\$\{UID\}$", text, re.M)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["operator"]["uid"]  # the chart's runAsUser is the image's user
    for key in ("title", "description", "version", "revision", "created", "licenses", "source", "base.name"):
        assert f"org.opencontainers.image.{key}=" in text, key
    env = text[text.index("ENV PATH="):]
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/tmp/" in env  # writable under a RO root with /tmp mounted
    if image == "runtime":
        assert "TRITON_CACHE_DIR=/tmp/" in env and "TORCHINDUCTOR_CACHE_DIR=/tmp/" in env


def test_each_image_gets_only_its_own_extras() -> None:
    wh = wheelhouse()
    names = lambda reqs: {wh._name(r) for r in reqs}  # noqa: E731
    runtime_cpu, runtime_cuda, operator = (names(wh.requirements("runtime", "cpu")), names(wh.requirements("runtime", "cuda")),
                                           names(wh.requirements("operator", "cpu")))
    assert "torch==2.13.0" in wh.requirements("runtime", "cpu")  # pinned: an unpinned torch is the CUDA build
    assert "triton" not in runtime_cpu and "triton" in runtime_cuda
    assert not runtime_cpu & {"kopf", "kubernetes_asyncio", "pytest", "transformers"}
    assert not operator & {"torch", "triton", "fastapi", "pytest", "kmock"}
    assert {"kopf", "kubernetes_asyncio", "prometheus-client"} <= operator
