"""Where students train: nothing POSIX-only at import, so nanolm starts on Windows.

``tests/windows_like.py`` runs nanolm with its POSIX-only imports refused and Windows' lock
module stood in for (what it can and cannot show is said there). The Mac's GPU paths are
played by ``tests/simulated_device.py`` in ``tests/test_devices.py``.
"""

import subprocess
import sys

import pytest
from conftest import REPO, TINY_TRAIN

from nanolm.run.config import RunConfig, load_toml

LAUNCHER = REPO / "tests" / "windows_like.py"


def _windows_like(*args, timeout=300, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        **popen,
    )


def test_nanolm_imports_nothing_posix_only():
    """Every module of the package, instruments included, imports without a POSIX-only module."""
    code = (
        "import importlib, pkgutil, nanolm, sys\n"
        "names = [m.name for m in pkgutil.walk_packages(nanolm.__path__, 'nanolm.') if not m.name.endswith('__main__')]\n"
        "for name in names: importlib.import_module(name)\n"
        "from nanolm.base.lock import fcntl; assert fcntl is None, 'the lock still found fcntl'\n"
        "print(len(names), 'modules')"
    )
    done = _windows_like("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[0]) > 40


def test_the_launcher_refuses_what_windows_lacks():
    """The stand-in is not vacuous: nanolm's own import of ``fcntl`` fails under it."""
    done = _windows_like(
        "-c",
        "import nanolm.base.lock, sys\n"
        "sys.modules.pop('nanolm.base.lock')\n"
        "g = {'__name__': 'nanolm.probe'}\n"
        "exec('import fcntl', g)",
    )
    assert done.returncode != 0 and "POSIX only; refused as on Windows" in done.stderr


def test_train_resume_and_a_second_writer_refused_without_posix_modules(tmp_path, stories_file):
    """The promise a Windows user relies on first: a run trains, the same command continues
    it, and a second writer on a live run is refused in one line naming the holder, with the
    lock taken by Windows' byte-range locking."""
    out = tmp_path / "run"
    command = [
        "-m",
        "nanolm",
        "train",
        "--data",
        stories_file,
        "--out-dir",
        out,
        "--tokenizer",
        "char",
        *TINY_TRAIN,
        "--log-every",
        "2",
        "--eval-every",
        "4",
        "--threads",
        "1",
    ]
    first = _windows_like(*command, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _windows_like(*command, "--steps", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resum" in resumed.stdout.lower() + resumed.stderr.lower()
    assert load_toml(out / "config.toml")["train"]["steps"] == 6
    holder = subprocess.Popen(
        [
            sys.executable,
            str(LAUNCHER),
            "-c",
            "import sys, time; from nanolm.base.lock import RunLock; RunLock().take(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = _windows_like(*command, "--steps", "8", "--lr", "1e-2")
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is being written by process {holder.pid} on" in lines[0], second.stderr
    after = _windows_like(*command, "--steps", "8")  # the holder died: the lock died with it
    assert after.returncode == 0, after.stderr[-3000:]


@pytest.mark.parametrize("path", [r"C:\Users\student\runs\tiny", r"\\server\share\data.txt", "D:/mixed\\slashes"])
def test_a_windows_path_survives_config_toml(path, tmp_path):
    """Backslashes are TOML escapes: a Windows path written unescaped into config.toml would
    come back as another path, or not parse, when the run is continued."""
    cfg = RunConfig()
    cfg.data.data, cfg.train.out_dir = path, path
    (tmp_path / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    read = load_toml(tmp_path / "config.toml")
    assert read["data"]["data"] == path and read["train"]["out_dir"] == path
