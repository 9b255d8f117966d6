"""Atomic, owned report directories: `--out` is checked before any work, and a report appears whole or not at all.

`ReportDir(out)` checks the path (a directory or creatable; writable; not a file or under one; not the
current directory; an existing non-empty directory must be an earlier reward-lens report, marked by
`MARKER`), then `with` takes a lock file beside it (`<out>.lock`, created exclusively: a second writer is
refused, a lock left by a dead process is taken over). `commit(write)` writes the files into a temporary
directory beside `out` and swaps it in with renames, so an earlier report's files are replaced as a set;
an interrupt (Ctrl-C) leaves the previous complete report or none, and the temporary directory is removed.

`clean_json` / `write_json` / `write_csv` keep NaN and ±inf out of every file: JSON null, an empty CSV cell.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

MARKER = ".reward-lens-report"


class OutputError(ValueError):
    """`--out` cannot hold a report; the message says why and what to do."""


def check_out_dir(out: Union[str, Path, None], sweep: bool = False) -> Path:
    """`out` as an absolute path that can hold a report (`sweep`: a resumable sweep, `SweepDir`); an
    OutputError (one line) otherwise."""
    if out is None or str(out).strip() == "":
        raise OutputError("the output directory is empty (--out ''); give a directory name such as reward-lens-report")
    path = Path(out).expanduser().absolute()
    if path.resolve() == Path.cwd().resolve():
        raise OutputError(f"--out {str(out)!r} is the current directory; reports go into their own directory "
                          "(e.g. --out reward-lens-report), which is replaced as a whole")
    if path.exists() and not path.is_dir():
        raise OutputError(f"--out {str(path)!r} is a file, not a directory; choose another --out")
    if sweep and path.is_dir() and any(path.iterdir()) and not (path / SWEEP_MANIFEST).is_file():
        raise OutputError(f"--out {str(path)!r} is a non-empty directory that is not a reward-lens sweep; choose a "
                          "new or empty directory (a sweep there is resumed)")
    if not sweep and path.is_dir() and any(path.iterdir()) and not is_report_dir(path):
        raise OutputError(f"--out {str(path)!r} is a non-empty directory that is not a reward-lens report; "
                          "choose a new or empty directory (an earlier report there would be replaced)")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"--out {str(path)!r} lies under {str(parent)!r}, which is a file; choose another --out")
    for place in (parent, path) if path.exists() else (parent,):
        if not _writable(place):
            raise OutputError(f"--out {str(path)!r}: cannot write in {str(place)!r} (no permission or a read-only "
                              "file system); choose a writable place")
    return path


def _writable(directory: Path) -> bool:
    """A real probe (a temporary file, removed at once): os.access is wrong for root and read-only mounts."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def is_report_dir(path: Path) -> bool:
    """Marked by an earlier run, or an unmarked report of an older reward-lens (only its file types)."""
    if (path / MARKER).exists():
        return True
    names = list(path.iterdir())
    return (path / "report.html").is_file() and (path / "results.json").is_file() and all(
        n.is_file() and n.suffix in (".html", ".json", ".csv") for n in names)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


SWEEP_MANIFEST = "sweep.json"


class ReportDir:
    """A checked output directory with an exclusive lock; `commit(write)` swaps a finished report in."""

    def __init__(self, out: Union[str, Path], sweep: bool = False):
        self.path = check_out_dir(out, sweep)
        self.lock = self.path.with_name(self.path.name + ".lock")
        self._held = False
        self._depth = 0  # re-entrant: the CLI holds the lock, run_audit enters again

    def __enter__(self) -> "ReportDir":
        if self._depth == 0:
            self.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.release()

    def acquire(self) -> None:
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and not _pid_alive(pid):  # left by a run that died: take it over
                    self.lock.unlink(missing_ok=True)
                    continue
                raise OutputError(f"another reward-lens run (pid {pid or '?'}) is writing {str(self.path)!r} (lock "
                                  f"{self.lock.name}); wait for it, use another --out, or delete the lock if it is stale")
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self._held = True
            return

    def release(self) -> None:
        if self._held:
            self.lock.unlink(missing_ok=True)
            self._held = False

    def commit(self, write: Callable[[Path], None]) -> Path:
        """Run `write(tmp)` into a fresh directory beside `path`, then replace `path` with it (two renames)."""
        if not self._held:
            raise RuntimeError("ReportDir.commit needs the lock: use `with ReportDir(out) as rd: rd.commit(...)`")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        old: Optional[Path] = None
        try:
            write(tmp)
            (tmp / MARKER).write_text("written by reward-lens; this directory is replaced as a whole by the next run\n")
            if self.path.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
                old.rmdir()
                os.replace(self.path, old)
            os.replace(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and old.exists() and not self.path.exists():  # interrupted between the renames
                os.replace(old, self.path)
                old = None
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return self.path


def clean_json(x: Any) -> Any:
    """Plain JSON values; NaN and ±inf become null (strict JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return clean_json(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    return x


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(clean_json(data), indent=1, allow_nan=False, default=str))


def write_csv(path: Path, frame: Any) -> None:
    """A tidy CSV with ±inf written as empty cells, like NaN."""
    frame = frame.replace([np.inf, -np.inf], np.nan) if len(frame) else frame
    frame.to_csv(path, index=False)


def provenance(pairs_file: Union[str, Path, None], options: Optional[dict] = None) -> dict:
    """What results.json records about the run: library version, pairs file (path, format, sha256), options."""
    from reward_lens.version import __version__

    info: dict = {"reward_lens_version": __version__, "report_format": 1}
    if pairs_file is not None:
        path = Path(pairs_file)
        info["pairs_file"] = {"path": str(path.absolute()), "format": path.suffix.lower().lstrip("."),
                              "sha256": file_sha256(path)}
    if options is not None:
        info["options"] = {k: v for k, v in options.items() if not callable(v)}
    return info


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
