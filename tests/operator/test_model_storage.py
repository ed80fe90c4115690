"""spec.model.storage: a PVC, hostPath or image volume mounted read-only in every worker, or an emptyDir a
download init container fills; the model's hash in the revision. The init container's script is run for real
against a loopback HTTP server (download, verify, skip when present, refuse a wrong hash)."""

from __future__ import annotations

import hashlib
import http.server
import subprocess
import sys
import threading

import pytest

from pdoperator.core.render import Owner, worker_pod
from pdoperator.core.revisions import controller_revision, revision_hash
from pdoperator.core.spec import SpecError, parse_spec

OWNER = Owner("llm", "ns", "u")


def _pod(model):
    return worker_pod(parse_spec({"image": "rt:1", "model": model}), OWNER, "r", 0, "decode", "0")["spec"]


@pytest.mark.parametrize("storage,volume", [
    ({"pvc": {"claimName": "models", "readOnly": True}},
     {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ({"hostPath": {"path": "/mnt/models", "type": "Directory"}},
     {"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}}),
    ({"image": {"reference": "registry.example.com/models/llama:8b", "pullPolicy": "IfNotPresent"}},
     {"name": "model", "image": {"reference": "registry.example.com/models/llama:8b", "pullPolicy": "IfNotPresent"}}),
])
def test_each_storage_kind_is_one_read_only_model_volume(storage, volume):
    spec = _pod({"source": "/models/llama.gguf", "storage": storage})
    assert volume in spec["volumes"] and "initContainers" not in spec
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]


def test_download_into_an_empty_dir_runs_an_init_container_with_the_hash():
    sha = "ab" * 32
    spec = _pod({"source": "/models/m.gguf", "sha256": sha,
                 "storage": {"download": {"url": "https://example.com/m.gguf", "sizeLimit": "20Gi"}}})
    assert {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}} in spec["volumes"]
    init = spec["initContainers"][0]
    assert init["name"] == "model-download" and init["command"][3:] == ["https://example.com/m.gguf", "/models/m.gguf", sha]
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]  # writable for the download only
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_model_hash_and_storage_are_in_the_revision():
    raw = {"image": "rt:1", "model": {"source": "/models/m.gguf", "sha256": "ab" * 32,
                                      "storage": {"pvc": {"claimName": "models"}}}}
    spec = parse_spec(raw, name="llm")
    cr = controller_revision("llm", "ns", OWNER.reference(), spec, revision_hash(spec), 1, "t")
    assert cr["data"]["config"]["model"]["sha256"] == "ab" * 32
    assert cr["data"]["config"]["model"]["storage"]["source"] == {"claimName": "models"}
    other = {**raw, "model": {**raw["model"], "sha256": "cd" * 32}}
    assert revision_hash(parse_spec(other, name="llm")) != revision_hash(spec)  # new weights: a rollout


@pytest.mark.parametrize("model,fragment", [
    ({"storage": {"pvc": {"claimName": "a"}, "hostPath": {"path": "/x"}}}, "exactly one of pvc, hostPath, image"),
    ({"storage": {}}, "exactly one of pvc"),
    ({"source": "/elsewhere/m.gguf", "storage": {"pvc": {"claimName": "a"}}}, "outside spec.model.storage.mountPath"),
    ({"storage": {"pvc": {"claimName": "a", "readOnly": True}, "download": {"url": "https://x/m"}}}, "readOnly"),
    ({"storage": {"image": {"reference": "r"}, "download": {"url": "https://x/m"}}}, "download with image"),
    ({"storage": {"download": {"url": "ftp://x/m"}}}, "an http(s) URL"),
    ({"sha256": "nothex"}, "64 lowercase hex digits"),
])
def test_bad_model_storage_is_rejected_with_what_is_accepted(model, fragment):
    with pytest.raises(SpecError) as e:
        parse_spec({"image": "rt:1", "model": model})
    assert fragment in str(e.value) and "accepted" in str(e.value)


def test_the_download_script_fetches_verifies_and_skips(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 64
    served = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/m.gguf"
        dest = tmp_path / "models" / "m.gguf"
        good = hashlib.sha256(payload).hexdigest()
        cmd = _pod({"source": "/models/m.gguf", "sha256": good,
                    "storage": {"download": {"url": "https://example.com/m.gguf"}}})["initContainers"][0]["command"]
        script = cmd[2]
        run = lambda sha: subprocess.run([sys.executable, "-c", script, url, str(dest), sha],  # noqa: E731
                                         capture_output=True, text=True, timeout=60)
        assert run(good).returncode == 0 and dest.read_bytes() == payload and len(served) == 1
        assert run(good).returncode == 0 and len(served) == 1  # present with the right hash: no download
        dest.unlink()
        bad = run("00" * 32)
        assert bad.returncode != 0 and "sha256 mismatch" in bad.stderr and not dest.exists()
    finally:
        srv.shutdown()
        srv.server_close()
