"""The warm zygote's socket directory is private (issue 34, section 3): a directory another local user
made first, or made open, or a symlink planted in its place, is never used. Every job sends its whole
environment (API keys) and its stdio descriptors through a socket there, so a squatter listening on the
socket's name must receive nothing: the launcher runs the plain python instead, the client checks again
before it connects, and `zygote serve` refuses with exit 2 naming the directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tools.jobs import zygote as zy

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import REPO, assert_refused  # noqa: E402

SECRET = "sk-squatted-0123456789abcdef"


def _open_dir(root: Path) -> Path:
    folder = root / "zy"
    folder.mkdir()
    folder.chmod(0o777)  # what a squatter who made it first leaves behind
    return folder


def _foreign_dir(root: Path) -> Path:
    folder = root / "zy"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)  # nobody's: another local user made it first
    return folder


def _symlinked_dir(root: Path) -> Path:
    target = root / "elsewhere"
    target.mkdir(mode=0o700)
    (root / "zy").symlink_to(target)
    return root / "zy"


CASES = {"mode 0777": (_open_dir, "has mode 0777"), "another owner": (_foreign_dir, "owned by uid 65534"),
         "a symlink": (_symlinked_dir, "is not a directory")}


class Squatter:
    """A listener on the socket the client would connect to, recording whether anyone connected."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.received: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(2.0)
            try:
                self.received.append(conn.recv(1 << 20))
            except OSError:
                self.received.append(b"")
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.parametrize("case", CASES)
def test_the_launcher_never_uses_a_directory_that_is_not_private(tmp_path: Path, case: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    make, said = CASES[case]
    folder = make(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    handle = zy.Zygote(folder, preload=("json",), idle_s=5)
    assert handle.prepare(os.environ) is None  # the plain python runs the job
    assert handle.prepare(os.environ) is None
    err = capsys.readouterr().err
    assert err.count("zygote: not used") == 1 and str(folder) in err and said in err, err  # said once, naming it
    assert sorted(p.name for p in folder.iterdir()) == before  # no socket, lock or log written there
    assert zy.running(folder) == []  # and no zygote started
    with pytest.raises(PermissionError, match=said):
        handle.start(os.environ)


@pytest.mark.parametrize("case", CASES)
def test_zygote_serve_refuses_a_directory_that_is_not_private(tmp_path: Path, case: str) -> None:
    make, said = CASES[case]
    folder = make(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tools.jobs.zygote", "serve", "--socket", str(folder / "k.sock"),
                           "--preload", "json", "--idle-s", "5"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert_refused(proc.returncode, proc.stderr, str(folder), said)
    assert list(folder.iterdir()) == []
    assert zy.running(folder) == []


@pytest.mark.parametrize("case", CASES)
def test_a_client_sends_nothing_to_a_squatters_socket(tmp_path: Path, case: str) -> None:
    # The directory was replaced after the launcher checked it: the squatter listens on the very name the
    # job's command holds. The job must run, and its environment must not leave the process.
    make, _ = CASES[case]
    folder = make(tmp_path)
    squatter = Squatter(folder / "k.sock")
    try:
        proc = subprocess.run([sys.executable, "-P", str(REPO / "tools/jobs/zygote.py"), str(folder / "k.sock"),
                               "-u", "-m", "json.tool", "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PLANNER_KEY": SECRET, "SUBMITIT_LOCAL_TIMEOUT_S": "10"})
    finally:
        squatter.close()
    assert proc.returncode == 0 and "usage" in proc.stdout  # the job ran, as a plain python
    assert squatter.received == [] and SECRET not in proc.stderr


def test_a_private_directory_is_created_0700_and_used(tmp_path: Path) -> None:
    # The control: the same calls with a directory of its own do start a zygote (so the refusals above
    # are about the directory, not about anything else in these calls).
    # A short base: under an xdist worker's longer temporary path the socket's would pass MAX_SOCKET_PATH, and
    # the zygote is (rightly) not used there.
    base = Path(tempfile.mkdtemp(prefix="zy-", dir="/tmp"))
    folder = base / "fresh" / "zy"
    handle = zy.Zygote(folder, preload=("json",), idle_s=5)
    try:
        handle.wait(os.environ, timeout_s=60)
        assert (folder.stat().st_mode & 0o777) == 0o700 and folder.stat().st_uid == os.getuid()
        assert len(zy.running(folder)) == 1
    finally:
        zy.stop(folder)
    assert zy.running(folder) == []
    shutil.rmtree(base, ignore_errors=True)
