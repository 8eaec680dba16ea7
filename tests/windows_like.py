"""Run Python as nanolm would meet Windows, on a POSIX machine: ``python tests/windows_like.py
-m nanolm train ...`` or ``python tests/windows_like.py -c CODE``.

No Windows machine is at hand, and a student's Windows laptop is where nanolm most often meets
its first user. What can be played here is what failed there first: importing a POSIX-only
module. So nanolm's own imports of them are refused (``fcntl``, ``resource``, ``termios`` ...:
PyTorch and the other libraries import what they need themselves and are left alone), and
``msvcrt``, Windows' module with the byte-range lock the run lock takes there, is stood in for
by POSIX record locks (``fcntl.lockf``), which also die with their holder. What this does not
show: Windows' file semantics (an open file cannot be removed or replaced), its paths and
signals; docs/gpu.md#windows-and-macs says what is verified how.
"""

import builtins
import errno
import fcntl
import os
import runpy
import sys
import types

POSIX_ONLY = {"fcntl", "resource", "termios", "tty", "pty", "pwd", "grp", "syslog", "crypt", "nis", "spwd", "posix"}


def _importer_is_nanolm(globals_) -> bool:
    return (globals_ or {}).get("__name__", "").split(".")[0] == "nanolm"


_import = builtins.__import__


def _windows_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and _importer_is_nanolm(globals):
        if name.split(".")[0] in POSIX_ONLY:
            raise ModuleNotFoundError(f"No module named {name!r} (POSIX only; refused as on Windows)", name=name)
        if name == "msvcrt":  # for nanolm only: other libraries would take this machine for Windows
            return MSVCRT
    return _import(name, globals, locals, fromlist, level)


def _msvcrt() -> types.ModuleType:
    """``msvcrt.locking`` as Windows has it: lock ``nbytes`` from the file's position, without
    waiting (``LK_NBLCK``), or unlock them (``LK_UNLCK``); a held range fails with EDEADLOCK."""
    module = types.ModuleType("msvcrt")
    module.LK_UNLCK, module.LK_LOCK, module.LK_NBLCK, module.LK_RLCK, module.LK_NBRLCK = 0, 1, 2, 3, 4

    def locking(fd, mode, nbytes):
        start = os.lseek(fd, 0, os.SEEK_CUR)
        operation = fcntl.LOCK_UN if mode == module.LK_UNLCK else fcntl.LOCK_EX | fcntl.LOCK_NB
        try:
            fcntl.lockf(fd, operation, nbytes, start, os.SEEK_SET)
        except OSError as e:
            raise OSError(errno.EDEADLOCK, "Resource deadlock avoided") from e

    module.locking = locking
    return module


MSVCRT = _msvcrt()


def main() -> None:
    builtins.__import__ = _windows_import
    flag, target, *rest = sys.argv[1:]
    sys.argv = [target, *rest]
    if flag == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif flag == "-c":
        sys.argv[0] = "-c"
        exec(compile(target, "<windows_like>", "exec"), {"__name__": "__main__"})
    else:
        raise SystemExit("usage: windows_like.py -m MODULE ARGS... | -c CODE ARGS...")


if __name__ == "__main__":
    main()
