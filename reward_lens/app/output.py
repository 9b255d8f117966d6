"""Atomic, owned report directories: `--out` is checked before any work, and a report appears whole or not at
all.

`ReportDir(out)` checks the path (a directory or creatable; writable; not a file or under one; not the
current directory; an existing non-empty directory must be an earlier reward-lens report, marked by
`MARKER`, holding no file its report did not write (the marker lists them); a symlink is followed, a
dangling one refused), then `with` takes a lock file beside it (`<out>.lock`, created exclusively: a
second writer is refused, a lock left by a dead process is taken over, by one run only: every holder
keeps an exclusive flock on it). `commit(write)` writes the files
into a temporary directory beside `out` and swaps it in with renames, so an earlier report's files are
replaced as a set; an interrupt (Ctrl-C) leaves the previous complete report or none, and the temporary
directory is removed.
The new directory keeps the old one's permission bits (a new one gets the umask's).

`check_out_file(out, source)` does the same checks for a one-file output (`monitor`'s HTML page): never the
input file itself, never a file reward-lens did not write; `write_text_atomic` writes it whole or not at all.

`clean_json` / `write_json` / `write_csv` keep NaN and ±inf out of every file: JSON null, an empty CSV cell.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Union

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no flock; the pid file alone decides
    fcntl = None  # type: ignore[assignment]

MARKER = ".reward-lens-report"
WRITTEN: List[Path] = []  # every report swapped in whole by this process, in order (the CLI's Ctrl-C says so)


class OutputError(ValueError):
    """`--out` cannot hold a report; the message says why and what to do."""


def check_out_dir(out: Union[str, Path, None], sweep: bool = False) -> Path:
    """`out` as an absolute path that can hold a report (`sweep`: a resumable sweep, `SweepDir`); an
    OutputError (one line) otherwise. A symlink is followed to its directory (a dangling one is refused)."""
    if out is None or str(out).strip() == "":
        raise OutputError(
            "the output directory is empty (--out ''); give a directory name such as reward-lens-report"
        )
    path = _follow_link(Path(out).expanduser().absolute(), out)
    if path.resolve() == Path.cwd().resolve():
        raise OutputError(
            f"--out {str(out)!r} is the current directory; reports go into their own directory (e.g. "
            "--out reward-lens-report), which is replaced as a whole"
        )
    if path.exists() and not path.is_dir():
        raise OutputError(f"--out {str(path)!r} is a file, not a directory; choose another --out")
    if sweep and path.is_dir() and any(path.iterdir()) and not (path / SWEEP_MANIFEST).is_file():
        raise OutputError(
            f"--out {str(path)!r} is a non-empty directory that is not a reward-lens sweep; choose a new "
            "or empty directory (a sweep there is resumed)"
        )
    if not sweep and path.is_dir() and any(path.iterdir()):
        if not is_report_dir(path):
            raise OutputError(
                f"--out {str(path)!r} is a non-empty directory that is not a reward-lens report; choose a "
                "new or empty directory (an earlier report there would be replaced)"
            )
        extra = foreign_files(path)
        if extra:
            raise OutputError(
                f"--out {str(path)!r} holds files the earlier report did not write ({_names(extra)}); a "
                "new report would replace the directory: move them out or choose another --out"
            )
    _check_parent(path)
    return path


def _follow_link(path: Path, given: Any) -> Path:
    """A symlinked `--out` as its target directory; a dangling link is refused before any work."""
    if not path.is_symlink():
        return path
    target = path.resolve()
    if not target.exists():
        raise OutputError(
            f"--out {str(given)!r} is a symbolic link to {str(target)!r}, which does not exist; create "
            "the target directory or give another --out"
        )
    return target


def _check_parent(path: Path, is_file: bool = False) -> None:
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(
            f"--out {str(path)!r} lies under {str(parent)!r}, which is a file; choose another --out"
        )
    for place in (parent, path) if path.exists() and not is_file else (parent,):
        if not _writable(place):
            raise OutputError(
                f"--out {str(path)!r}: cannot write in {str(place)!r} (no permission or a read-only file "
                "system); choose a writable place"
            )


def _names(names: List[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def written_files(path: Path) -> Optional[List[str]]:
    """The names an earlier report in `path` wrote, from its marker's manifest (None: an older, unlisted
    marker)."""
    try:
        listed = json.loads((path / MARKER).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(n) for n in listed] if isinstance(listed, list) else None


def foreign_files(path: Path) -> List[str]:
    """Entries of report directory `path` that its report did not write (the user's own files), sorted.
    Without a manifest (older reports) only plain .html/.json/.csv files count as the report's."""
    listed = written_files(path)
    names = sorted(n.name for n in path.iterdir() if n.name != MARKER)
    if listed is not None:
        return [n for n in names if n not in listed]
    return [
        n
        for n in names
        if not (
            (path / n).is_file()
            and not (path / n).is_symlink()
            and Path(n).suffix in (".html", ".json", ".csv")
        )
    ]


def new_mode(existing: Path) -> int:
    """The permission bits a replacing directory gets: the existing directory's, else the umask's (and the
    parent's setgid bit, as mkdir gives it)."""
    if existing.is_dir():
        return existing.stat().st_mode & 0o7777
    mask = new_mode_mask()
    parent = existing.parent
    while not parent.exists():
        parent = parent.parent
    return (0o777 & ~mask) | (parent.stat().st_mode & stat.S_ISGID)


GENERATOR = '<meta name="generator" content="reward-lens">'


def check_out_file(out: Union[str, Path], source: Union[str, Path], option: str = "--out") -> Path:
    """An output file path (absolute, symlinks followed) that may be (over)written: not `source` (the input),
    not a directory, and if it exists, a page reward-lens wrote. OutputError (one line) otherwise."""
    if str(out).strip() == "":
        raise OutputError(f"the output file is empty ({option} ''); give a file name such as monitor.html")
    path = _follow_link(Path(out).expanduser().absolute(), out)
    if path.exists() and path.resolve() == Path(source).expanduser().resolve():
        raise OutputError(
            f"{option} {str(out)!r} is the input file itself; it would be overwritten: give another "
            f"{option} (e.g. {Path(source).with_suffix('.html').name})"
        )
    if path.is_dir():
        raise OutputError(
            f"{option} {str(out)!r} is a directory; give a file name (e.g. "
            f"{str(Path(out) / 'monitor.html')!r})"
        )
    if path.exists():
        try:
            with open(path, "rb") as f:
                head = f.read(4096).decode("utf-8", errors="replace")
        except OSError as exc:
            raise OutputError(
                f"{option} {str(out)!r} cannot be read ({exc.strerror}); choose another {option}"
            ) from None
        if GENERATOR not in head and "<title>reward-lens" not in head:
            raise OutputError(
                f"{option} {str(out)!r} exists and was not written by reward-lens; it would be "
                f"overwritten: choose another {option} or delete it"
            )
    _check_parent(path, is_file=True)
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """`text` into `path` through a temporary file beside it and one rename (mode kept, or the umask's)."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~new_mode_mask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    WRITTEN.append(path)
    return path


def new_mode_mask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    return (
        (path / "report.html").is_file()
        and (path / "results.json").is_file()
        and all(n.is_file() and n.suffix in (".html", ".json", ".csv") for n in names)
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


SWEEP_MANIFEST = "sweep.json"


def take_lock(lock: Path, target: Path) -> Optional[int]:
    """Create `lock` exclusively (holding this pid); a live holder is refused (one line), a dead one's lock
    taken over. Returns the descriptor that holds the lock (give it to `release_lock`).

    Every holder keeps an exclusive `flock` on the file for as long as it holds it, so taking over a dead
    run's lock is atomic: of many runs racing for it, only the one whose `flock` succeeds rewrites it, and
    the others then see a live holder. A file without a pid yet (a run between creating and writing it)
    counts as held."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            fd = _take_over(lock, target)
            if fd is None:
                continue  # the lock was released meanwhile: create it afresh
            return fd
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new inode: a racing run holds it only to see it has no pid
        os.write(fd, str(os.getpid()).encode())
        return fd
    raise OutputError(
        f"the lock {lock.name} for {str(target)!r} keeps changing hands; another run is starting: retry"
    )


def _refuse_held(lock: Path, target: Path, pid: int) -> None:
    raise OutputError(
        f"another reward-lens run (pid {pid or '?'}) is writing {str(target)!r} (lock "
        f"{lock.name}); wait for it, use another --out, or delete the lock if it is stale"
    )


def _read_pid(lock: Path) -> int:
    try:
        return int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _take_over(lock: Path, target: Path) -> Optional[int]:
    """The descriptor of the existing `lock`, now held by this process, when its holder is dead; a refusal
    when it lives; None when the file vanished (released) meanwhile."""
    if fcntl is None:  # no flock: the pid alone decides (not atomic)
        pid = _read_pid(lock)
        if not pid or _pid_alive(pid):
            _refuse_held(lock, target, pid)
        lock.unlink(missing_ok=True)
        return None
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live holder keeps its flock
            _refuse_held(lock, target, _read_pid(lock))
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released (unlinked) between our open and our flock
            os.close(fd)
            return None
        pid = _read_pid(lock)
        if not pid or _pid_alive(pid):
            _refuse_held(lock, target, pid)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def release_lock(lock: Path, fd: Optional[int]) -> None:
    """Remove `lock` while still holding it (so no waiting run takes over a file about to vanish), then
    close its descriptor."""
    lock.unlink(missing_ok=True)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def locked_file(path: Path) -> Iterator[Path]:
    """A one-file output (`monitor`'s page) written under `<path>.lock`, as a report directory is."""
    lock = path.with_name(path.name + ".lock")
    fd = take_lock(lock, path)
    try:
        yield path
    finally:
        release_lock(lock, fd)


class ReportDir:
    """A checked output directory with an exclusive lock; `commit(write)` swaps a finished report in."""

    def __init__(self, out: Union[str, Path], sweep: bool = False):
        self.path = check_out_dir(out, sweep)
        self.lock = self.path.with_name(self.path.name + ".lock")
        self._held = False
        self._fd: Optional[int] = None
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
        self._fd = take_lock(self.lock, self.path)
        self._held = True

    def release(self) -> None:
        if self._held:
            release_lock(self.lock, self._fd)
            self._held = False

    def commit(self, write: Callable[[Path], None]) -> Path:
        """Run `write(tmp)` into a fresh directory beside `path`, then replace `path` with it (two renames).
        The new directory keeps the old one's permissions; files that appeared in the old one during the run
        (not written by its report) are moved into the new one, not deleted."""
        if not self._held:
            raise RuntimeError(
                "ReportDir.commit needs the lock: use `with ReportDir(out) as rd: rd.commit(...)`"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        old: Optional[Path] = None
        try:
            write(tmp)
            names = sorted(n.name for n in tmp.iterdir())
            manifest = {
                "written_by": "reward-lens",
                "note": "this directory is replaced as a whole by the next run; files not listed here "
                "are kept",
                "files": names,
            }
            (tmp / MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
            os.chmod(tmp, new_mode(self.path))
            if self.path.exists():
                self._keep_foreign(tmp)
                old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
                old.rmdir()
                os.replace(self.path, old)
            os.replace(tmp, self.path)
        except BaseException:
            if old is not None and old.exists() and not self.path.exists():  # interrupted between the renames
                os.replace(old, self.path)
                old = None
            if tmp.exists() and self.path.exists():
                self._restore_foreign(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        WRITTEN.append(self.path)
        return self.path

    def _keep_foreign(self, tmp: Path) -> None:
        """Move the user's files (not the earlier report's) from `path` into the new report `tmp`."""
        self._moved = []
        for name in foreign_files(self.path):
            if (tmp / name).exists():
                raise OutputError(
                    f"--out {str(self.path)!r}: {name} appeared there during the run and the new report "
                    "writes a file of that name; move it out and rerun"
                )
            os.replace(self.path / name, tmp / name)
            self._moved.append(name)

    def _restore_foreign(self, tmp: Path) -> None:
        for name in getattr(self, "_moved", []):
            if (tmp / name).exists() and not (self.path / name).exists():
                os.replace(tmp / name, self.path / name)
        self._moved = []


def check_finite_columns(frame: Any, columns: Any, what: str, dtype: Any = None) -> None:
    """A ValueError (one line: how many, the first row's pair and site, what to do) when any of `columns` of
    `frame` holds NaN or ±inf: a computed reward is never written as an empty cell."""
    cols = [c for c in columns if c in getattr(frame, "columns", ())]
    if not cols or not len(frame):
        return
    values = frame[cols].to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)
    if not bad.any():
        return
    row = frame.iloc[int(np.argmax(bad.any(axis=1)))]
    keys = [k for k in ("pair", "site", "component", "mode", "target") if k in frame.columns]
    where = ", ".join(f"{k} {row[k]}" for k in keys)
    fp16 = "float16" in str(dtype)
    hint = (
        "float16's range (±65504) overflowed: rerun with --dtype bfloat16 or float32"
        if fp16
        else "the model's activations overflow or its weights are damaged: rerun with --dtype float32 or "
        "check them"
    )
    raise ValueError(
        f"{what}: {int(bad.sum())} value(s) of {'/'.join(cols)} are NaN or infinite (first at {where}); "
        f"{hint}"
    )


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
    """A tidy CSV with ±inf written as empty cells, like NaN, that `pandas.read_csv` reads back as written.

    Lines end in CRLF (RFC 4180), so the csv writer quotes every cell holding a CR or an LF (with its
    default LF ending, a lone CR, which tokens can hold, went unquoted and split the row on reading).
    What no quoting can carry: a text cell spelled like a missing value ('NA', 'None', 'null', ...) reads
    back as NaN unless read with `keep_default_na=False, na_values=['']`; an empty one reads as NaN."""
    frame = frame.replace([np.inf, -np.inf], np.nan) if len(frame) else frame
    frame.to_csv(path, index=False, lineterminator="\r\n")


def provenance(pairs_file: Union[str, Path, None], options: Optional[dict] = None) -> dict:
    """What results.json records about the run: library version, pairs file (path, format, sha256),
    options."""
    from reward_lens.version import __version__

    info: dict = {"reward_lens_version": __version__, "report_format": 1}
    if pairs_file is not None:
        path = Path(pairs_file)
        info["pairs_file"] = {
            "path": str(path.absolute()),
            "format": path.suffix.lower().lstrip("."),
            "sha256": file_sha256(path),
        }
    if options is not None:
        info["options"] = {k: v for k, v in options.items() if not callable(v)}
    return info


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
