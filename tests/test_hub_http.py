"""Pretrained weights downloaded over real HTTP, as a user's ``timm.create_model("hf-hub:...", pretrained=True)``.

A self-hosted Hub mirror (olah, installed by ``scripts/bootstrap.sh`` in ``.cache/olah``, its own virtual
environment) serves, on a free loopback port in offline mode, the folder ``scripts/push_to_hub.py --dry-run``
writes, committed as a git repository under its mirrors path. ``HF_ENDPOINT`` points ``huggingface_hub`` at it:
the download goes through its endpoint, ETag, revision and cache handling. Everything is written under the
test's temporary folder; the server is stopped at the end.
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import timm
import torch

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv.hub import PretrainedLoadError, load_pretrained

REPO_ROOT = Path(__file__).resolve().parents[1]
OLAH = REPO_ROOT / ".cache" / "olah" / "bin" / "olah-cli"
MODEL = "scnn_p_rs_3"
pytestmark = pytest.mark.slow  # a server start and five interpreters: 10-30 s per test on 2 shared cores
GOOD, BROKEN = "sortconv-test/scnn_p_rs_3.mnist", "sortconv-test/broken"


def _olah() -> Path:
    if OLAH.is_file():
        return OLAH
    message = f"{OLAH} is missing: scripts/bootstrap.sh installs the Hub mirror server there"
    if os.environ.get("CI"):
        pytest.fail(message)  # CI runs bootstrap.sh first: a missing server there is a broken set-up
    pytest.skip(message)


def _commit(folder: Path) -> str:
    """``folder`` as a git repository with one commit of its files; returns the commit's hash."""
    git = ["git", "-C", str(folder), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for command in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "Add model"]):
        subprocess.run(git + command, check=True, capture_output=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mirror:
    """olah on 127.0.0.1, offline, serving the repositories under ``root/mirrors``."""

    def __init__(self, root: Path):
        self.root = root
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        config = self.root / "olah.toml"
        config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\n'
                          f'repos-path = {json.dumps(str(self.root / "repos"))}\n'
                          f'mirrors-path = [{json.dumps(str(self.root / "mirrors"))}]\n'
                          '[accessibility]\noffline = true\n')
        log = open(self.root / "olah.out", "wb")
        self.process = subprocess.Popen([str(_olah()), "-c", str(config), "--log-path", str(self.root / "logs")],
                                        cwd=self.root, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"olah exited with {self.process.returncode}: "
                                   f"{(self.root / 'olah.out').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/{GOOD}/resolve/main/config.json", timeout=5).close()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"olah did not answer on {self.endpoint} within 120 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The bundled model's dry-run folder (and a copy with half its weights file) served by the mirror."""
    _olah()
    root = tmp_path_factory.mktemp("hub_http")
    checkpoint, card = root / "checkpoint.pth", root / "card.md"
    torch.save(timm.create_model(MODEL, pretrained=True).state_dict(), checkpoint)
    card.write_text("# test card\n")
    good = root / "mirrors" / "models" / GOOD
    env = {**os.environ, "TIMM_SORTCONV_DISABLE_FAST": "1"}
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "push_to_hub.py"), "--model", MODEL,
                    "--checkpoint", str(checkpoint), "--model-card", str(card), "--dry-run", str(good)],
                   check=True, capture_output=True, env=env)
    broken = root / "mirrors" / "models" / BROKEN
    broken.mkdir(parents=True)
    for file in good.iterdir():
        data = file.read_bytes()
        (broken / file.name).write_bytes(data[: len(data) // 2] if file.name == "model.safetensors" else data)
    commits = {GOOD: _commit(good), BROKEN: _commit(broken)}
    mirror = Mirror(root)
    mirror.start()
    yield mirror, root, commits
    mirror.stop()


LOAD = """
import json, sys, timm, torch, timm_sortconv
from timm_sortconv.hub import PretrainedLoadError, load_pretrained
repo, out = sys.argv[1], sys.argv[2]
if repo != sys.argv[4]:
    try:
        load_pretrained("hf-hub:" + repo)
    except PretrainedLoadError as error:
        json.dump({"error": str(error)}, open(out, "w"))
    sys.exit(0)
x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    downloaded = timm.create_model("hf-hub:" + repo, pretrained=True).eval()(x)
    bundled = timm.create_model(sys.argv[3], pretrained=True).eval()(x)
torch.save({"downloaded": downloaded, "bundled": bundled}, out)
"""


def _load(repo: str, root: Path, endpoint: str, out: Path):
    """Loads ``hf-hub:repo`` in a new process (``huggingface_hub`` reads ``HF_ENDPOINT`` when imported) with
    the test's own, initially empty, Hugging Face cache."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(root / "hf_cache"),
           "HF_HOME": str(root / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1", "TIMM_SORTCONV_DISABLE_FAST": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    script = root / "load.py"
    script.write_text(LOAD)
    result = subprocess.run([sys.executable, str(script), repo, str(out), MODEL, GOOD], env=env, cwd=root,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_weights_download_over_http_then_load_from_the_cache_with_the_server_stopped(served):
    mirror, root, commits = served
    snapshots = root / "hf_cache" / ("models--" + GOOD.replace("/", "--")) / "snapshots"
    assert not snapshots.exists()
    first = torch.load(_load(GOOD, root, mirror.endpoint, root / "first.pt"))
    assert torch.equal(first["downloaded"], first["bundled"])
    # huggingface_hub stored what the server sent, under the git commit the mirror serves
    assert sorted(p.name for p in snapshots.iterdir()) == [commits[GOOD]]
    assert sorted(p.name for p in (snapshots / commits[GOOD]).iterdir()) == ["config.json", "model.safetensors"]
    served_weights = root / "mirrors" / "models" / GOOD / "model.safetensors"
    assert (snapshots / commits[GOOD] / "model.safetensors").read_bytes() == served_weights.read_bytes()

    mirror.stop()
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(f"{mirror.endpoint}/{GOOD}/resolve/main/config.json", timeout=5)
    second = torch.load(_load(GOOD, root, mirror.endpoint, root / "second.pt"))
    assert torch.equal(second["downloaded"], first["bundled"])


@pytest.mark.slow
def test_a_corrupted_file_on_the_server_is_refused_as_a_local_one(served, tmp_path):
    mirror, root, commits = served
    mirror.start()  # (again, where the test before stopped it)
    error = json.loads(_load(BROKEN, root, mirror.endpoint, root / "broken.json").read_text())["error"]
    snapshot = root / "hf_cache" / ("models--" + BROKEN.replace("/", "--")) / "snapshots" / commits[BROKEN]
    local = tmp_path / "broken"
    local.mkdir()
    for file in (root / "mirrors" / "models" / BROKEN).iterdir():
        if file.is_file():
            (local / file.name).write_bytes(file.read_bytes())
    with pytest.raises(PretrainedLoadError) as caught:
        load_pretrained(local)
    assert "model.safetensors is not a readable safetensors file" in error
    assert error.replace(str(snapshot), "FOLDER") == str(caught.value).replace(str(local), "FOLDER")


@pytest.mark.slow
def test_a_repository_the_server_lacks_is_named(served):
    mirror, root, _ = served
    mirror.start()
    error = json.loads(_load("sortconv-test/absent", root, mirror.endpoint, root / "absent.json").read_text())["error"]
    assert error.startswith("hf-hub:sortconv-test/absent: config.json could not be downloaded"), error


def test_a_name_that_is_no_repository_is_refused():
    with pytest.raises(PretrainedLoadError, match="'hf-hub:no-organisation' names no Hub repository; "
                                                  "expected hf-hub:ORG/NAME"):
        load_pretrained("hf-hub:no-organisation")
