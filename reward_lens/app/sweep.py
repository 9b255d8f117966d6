"""`reward-lens sweep`: scripted ablation sweeps over a pairs file, as one tidy table; resumable;
torchrun-aware.

A sweep runs the chosen instruments (`patch`: contrastive activation patching, `atp`: attribution
patching, `attribute`: exact direct attribution) over every pair for the chosen levels, modes and
positions, and writes `sweep.parquet` and `sweep.csv`: the instruments' own tidy frames
(`PatchResult.to_frame()`, `AtPResult.to_frame()`, `AttributionResult.to_frame(level)`) stacked, with an
`instrument` column (a column an instrument does not have is empty in its rows).

Resuming: the pairs are cut into chunks of `chunk_size`; each finished chunk is written at once to
`parts/chunk-NNNNN.parquet` (atomically), and `sweep.json` (the manifest) records the options, the pairs'
fingerprint and the model. Rerunning the same command into the same `--out` skips the chunks already
written (a different sweep there is refused) and merges all parts in pair order at the end, so an
interrupted sweep ends with the same table as an uninterrupted one. Mean-ablation values are computed
once over all pairs and kept in `means.safetensors`.

Under torchrun, rank r takes chunks r, r + world, ... (disjoint; each writes its own parts), and rank 0
merges. Results equal the one-process sweep: a chunk is computed the same way whichever rank runs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pandas as pd
import torch

from reward_lens import distributed as dist
from reward_lens.app.output import SWEEP_MANIFEST, ReportDir, check_finite_columns, clean_json, write_csv
from reward_lens.core.autobatch import BatchSize
from reward_lens.core.pipeline import run_pipeline
from reward_lens.core.ranks import Ranks
from reward_lens.data.pairs import TokenPair, as_pairs, pair_labels
from reward_lens.instruments.attribution import AttributionSpec
from reward_lens.instruments.patching.atp import AtPSpec
from reward_lens.instruments.patching.contrastive import PatchSpec
from reward_lens.instruments.patching.spec import METHODS, MODES, POSITIONS
from reward_lens.instruments.sites import sites_for
from reward_lens.model.tokenization import model_input_format

INSTRUMENTS = ("patch", "atp", "attribute")
LEVELS = ("component", "head", "residual")
ATTRIBUTION_LEVELS = ("component", "head")
PARTS = "parts"
# computed values that are never NaN (normalised effects of tied pairs may be)
FINITE_COLUMNS = ("clean_reward", "patched_reward", "effect", "estimate", "chosen", "rejected", "gap")
MEANS = "means.safetensors"  # never a pickle: a crafted file cannot run code on resume


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep computes; `chunk_size` pairs per resumable part."""

    instruments: Tuple[str, ...] = ("patch",)
    levels: Tuple[str, ...] = ("component",)
    modes: Tuple[str, ...] = ("noising",)
    positions: str = "readout"
    method: str = "fast"
    chunk_size: int = 64

    def check(self) -> "SweepSpec":
        """Every option valid (a one-line ValueError naming the option otherwise)."""
        for name, given, allowed in (
            ("--instruments", self.instruments, INSTRUMENTS),
            ("--levels", self.levels, LEVELS),
            ("--modes", self.modes, MODES),
        ):
            bad = [v for v in given if v not in allowed]
            if not given or bad:
                raise ValueError(
                    f"{name}: {', '.join(bad) or 'nothing'} given; use one or more of "
                    f"{', '.join(allowed)} (comma-separated)"
                )
        if self.positions not in POSITIONS:
            raise ValueError(f"--positions {self.positions!r}: use one of {', '.join(POSITIONS)}")
        if self.method not in METHODS:
            raise ValueError(f"--method {self.method!r}: use one of {', '.join(METHODS)}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if "attribute" in self.instruments and not set(self.levels) & set(ATTRIBUTION_LEVELS):
            raise ValueError(
                f"--instruments attribute has no {'/'.join(self.levels)} terms; add --levels component or "
                "head"
            )
        return self


def pairs_fingerprint(pairs: Sequence[Any]) -> str:
    """SHA-256 of the pairs' contents (text or token ids) and ids, in order."""
    h = hashlib.sha256()
    for p in pairs:
        if isinstance(p, TokenPair):
            row = [p.chosen.tolist(), p.rejected.tolist(), p.prompt_len, p.id]
        else:
            row = p.to_dict()
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return h.hexdigest()


def part_path(out: Path, k: int) -> Path:
    return out / PARTS / f"chunk-{k:05d}.parquet"


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` beside `path`, then one rename: a part is there whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def chunk_frame(
    model,
    pairs: Sequence[Any],
    ids: List[str],
    sl: slice,
    spec: SweepSpec,
    means: Optional[Dict[str, torch.Tensor]],
    batch: BatchSize,
) -> pd.DataFrame:
    """The sweep table of pairs[sl]: each instrument's tidy frame with an `instrument` column."""
    specs, levels = {}, [lv for lv in spec.levels if lv in ATTRIBUTION_LEVELS]
    for name in spec.instruments:  # one pipeline: the instruments share the chunk's clean passes
        if name == "attribute":
            specs[name] = AttributionSpec(heads="head" in levels)
        elif name == "patch":
            specs[name] = PatchSpec(
                mode=list(spec.modes),
                level=list(spec.levels),
                positions=spec.positions,
                method=spec.method,
                means=means,
                name="patch",
            )
        else:
            specs[name] = AtPSpec(
                mode=list(spec.modes),
                level=list(spec.levels),
                positions=spec.positions,
                means=means,
                name="atp",
            )
    got = run_pipeline(model, pairs[sl], list(specs.values()), batch_size=batch, ranks=Ranks())
    frames = []
    for name in spec.instruments:
        res = got[specs[name].name]
        res.pair_ids = ids[sl]
        frame = (
            pd.concat([res.to_frame(lv) for lv in levels], ignore_index=True)
            if name == "attribute"
            else res.to_frame()
        )
        check_finite_columns(
            frame, FINITE_COLUMNS, f"sweep {name} on pairs {sl.start + 1}-{sl.stop}", model.cfg.dtype
        )
        frame.insert(0, "instrument", name)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


# what a resume must match
RESUME_KEYS = ("spec", "pairs_sha256", "n_pairs", "model", "dtype", "input_format")


def settings_digest(manifest: Dict[str, Any]) -> str:
    """SHA-256 of the settings a resume must match, kept in the manifest: a hand edit shows."""
    return hashlib.sha256(
        json.dumps([clean_json(manifest.get(k)) for k in RESUME_KEYS], sort_keys=True, default=str).encode()
    ).hexdigest()


def read_manifest(path: Path) -> Dict[str, Any]:
    """An earlier sweep's manifest, checked (a one-line ValueError saying what to do otherwise)."""
    start_over = f"delete {path.parent} (or its sweep.json and parts/) to start over, or use a new --out"
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason
        raise ValueError(f"{path} is damaged (not JSON: {why}); {start_over}") from None
    if not isinstance(earlier, dict) or not all(k in earlier for k in RESUME_KEYS[:4]):
        raise ValueError(
            f"{path} is not a reward-lens sweep manifest (it lacks spec, pairs_sha256, n_pairs or model); "
            f"{start_over}"
        )
    if "settings_sha256" in earlier and earlier["settings_sha256"] != settings_digest(earlier):
        raise ValueError(
            f"{path} was edited by hand (its settings no longer match their checksum), so its finished "
            f"parts may not be what it says; {start_over}"
        )
    return earlier


def _model_key(label: Any) -> Any:
    """A checkpoint given as a path, spelled any way (./dir, absolute, a trailing slash), as one key."""
    if isinstance(label, str) and label.strip():
        path = Path(label).expanduser()
        if path.exists():
            return str(path.resolve())
    return label


def _same(key: str, earlier: Any, now: Any) -> bool:
    if key == "model":
        return _model_key(earlier) == _model_key(clean_json(now))
    return earlier == clean_json(now)


def _prepare(out: Path, manifest: Dict[str, Any], echo: Callable[[str], None] = print) -> int:
    """Check an earlier sweep in `out` is this one (or start one); the number of parts already written.
    An earlier sweep with other settings is refused, unless none of its parts was finished (it was refused
    or stopped before any): then it is started again with these settings."""
    path = out / SWEEP_MANIFEST
    manifest = {**manifest, "settings_sha256": settings_digest(manifest)}
    done = len(list((out / PARTS).glob("chunk-*.parquet"))) if (out / PARTS).is_dir() else 0
    if path.exists():
        earlier = read_manifest(path)
        differ = [k for k in RESUME_KEYS if k in earlier and not _same(k, earlier.get(k), manifest[k])]
        if differ and done:
            key = differ[0]
            raise ValueError(
                f"--out {str(out)!r} holds a sweep with other {key.replace('_', ' ')} "
                f"({earlier.get(key)!r}, now {clean_json(manifest[key])!r}) and {done} finished part(s); "
                "rerun with its options to resume it, or use a new --out"
            )
        if not differ:
            return done
        echo(
            f"[reward-lens] sweep: the earlier sweep in {out} finished no part; starting again with these "
            "settings"
        )
        (out / MEANS).unlink(missing_ok=True)
    (out / PARTS).mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(clean_json(manifest), indent=1)))
    return done


def _means(
    model, pairs, spec: SweepSpec, out: Path, ranks, batch: BatchSize
) -> Optional[Dict[str, torch.Tensor]]:
    """Mean-ablation values over all pairs (kept in means.safetensors, so a resumed sweep patches in the
    same)."""
    if "mean" not in spec.modes or set(spec.instruments) <= {"attribute"}:
        return None
    from safetensors.torch import load_file, save_file

    path = out / MEANS
    if path.exists():
        try:
            return {k: v.to(model.cfg.device) for k, v in load_file(str(path)).items()}
        except Exception as exc:  # safetensors' SafetensorError: truncated or garbage
            raise ValueError(
                f"{path} is damaged ({type(exc).__name__}); delete it (it is recomputed) and rerun"
            ) from None
    means = dist.site_means(
        model, pairs, sites_for(model.cfg, list(spec.levels)), spec.positions, ranks=ranks, batch_size=batch
    )
    if ranks.is_main:
        plain = {k: v.detach().cpu().contiguous() for k, v in means.items()}
        write_atomic(path, lambda tmp: save_file(plain, str(tmp)))
    return means


def read_part(out: Path, k: int) -> pd.DataFrame:
    """One finished part; a damaged one is a one-line ValueError saying to delete it (it is recomputed)."""
    path = part_path(out, k)
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError on a damaged file
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        raise ValueError(
            f"{path} is damaged ({type(exc).__name__}); delete it (that chunk is recomputed) and rerun "
            "the same command"
        ) from None


def merge_parts(out: Path, n_chunks: int) -> pd.DataFrame:
    """All parts in pair order as one table; sweep.parquet and sweep.csv written (each atomically)."""
    table = pd.concat([read_part(out, k) for k in range(n_chunks)], ignore_index=True)
    write_atomic(out / "sweep.parquet", lambda tmp: table.to_parquet(tmp, index=False))
    write_atomic(out / "sweep.csv", lambda tmp: write_csv(tmp, table))
    return table


def run_sweep(
    model,
    pairs,
    out_dir: Union[str, Path],
    spec: SweepSpec = SweepSpec(),
    *,
    batch_size: Union[int, str, BatchSize] = 8,
    model_label: str = "",
    ranks: Optional[dist.Ranks] = None,
    run_info: Optional[Dict[str, Any]] = None,
    echo: Callable[[str], None] = print,
) -> Optional[pd.DataFrame]:
    """Run (or resume) the sweep into `out_dir`; the whole table on rank 0 (None on the other ranks)."""
    spec.check()
    ranks = ranks or dist.current()
    held = out_dir if isinstance(out_dir, ReportDir) else None  # the CLI checks and locks it first
    pairs = as_pairs(pairs)
    out = held.path if held is not None else Path(out_dir).expanduser().absolute()
    ids, batch = pair_labels(pairs), BatchSize.parse(batch_size, model.cfg.device, echo)
    n_chunks = -(-len(pairs) // spec.chunk_size)
    manifest = {
        **(run_info or {}),
        "spec": asdict(spec),
        "n_pairs": len(pairs),
        "n_chunks": n_chunks,
        "pairs_sha256": pairs_fingerprint(pairs),
        "model": model_label or model.cfg.model_name,
        "dtype": str(model.cfg.dtype).replace("torch.", ""),
        "input_format": model_input_format(model),
        "world_size": ranks.world_size,
    }
    with (held or ReportDir(out, sweep=True)) if ranks.is_main else contextlib.nullcontext():
        if ranks.is_main:
            done = _prepare(out, manifest, echo)
            echo(f"[reward-lens] sweep: {n_chunks} chunk(s) of {spec.chunk_size} pairs, {done} already done")
        ranks.barrier()  # the manifest is checked before any rank computes
        means = _means(model, pairs, spec, out, ranks, batch)
        for k in range(ranks.rank, n_chunks, ranks.world_size):
            if part_path(out, k).exists():
                continue
            sl = slice(k * spec.chunk_size, min(len(pairs), (k + 1) * spec.chunk_size))
            frame = chunk_frame(model, pairs, ids, sl, spec, means, batch)
            write_atomic(part_path(out, k), lambda tmp: frame.to_parquet(tmp, index=False))
            echo(f"[reward-lens] sweep: chunk {k + 1}/{n_chunks} written") if ranks.is_main else None
        ranks.barrier()
        if not ranks.is_main:
            return None
        table = merge_parts(out, n_chunks)
    echo(f"[reward-lens] wrote {out / 'sweep.parquet'} and sweep.csv ({len(table)} rows)")
    return table
