"""Watch a reward model during TRL training (GRPO, RLOO, any trainer taking `reward_funcs`).

    reward_fn = RewardLensReward(rm)                         # rm: a HookedRewardModel
    trainer = GRPOTrainer(model=policy, reward_funcs=reward_fn, args=GRPOConfig(..., report_to="wandb"), ...)
    watch(trainer, reward_fn, every=50, log_path="rm_monitor.jsonl")
    trainer.train()                                          # then: reward-lens monitor rm_monitor.jsonl

`RewardLensReward` is a reward function with TRL's signature (`prompts`, `completions`, `**kwargs` -> one
float per completion). It scores with the reward model's own tokenizer and input format, in batches, on its
device, and from the same forward records the exact split of each reward over embed / attention / MLP per
layer (mean and spread over the batch) and the reward-length correlation; these reach the trainer's logs
through TRL's `log_metric` hook as `reward_lens/...` (GRPO and RLOO pass it).

`RewardLensCallback` (added by `watch`) measures a fixed sample of the policy's most recent completions
(`sample_size`, so the cost does not grow with the batch): the hacking probes on those completions, their
projections on concept vectors, the components' shares of the reward and the reward-length correlation
(`reward_lens.integrations.signals.measure`). It does so once as the baseline, on the first completions
(those of the initial policy), and then every `every` steps; it logs through the trainer's own `log` (so
TensorBoard, W&B and any `report_to` backend receive `reward_lens/...` and the trainer's `log_history` holds
them) and appends every record to a JSONL file. A quantity whose interval leaves the baseline's is flagged
(`signals.drift_flags`); `reward_lens/drift_flags` counts them.

This module needs `transformers` only; the reward function is a plain callable, so TRL itself is imported
by the training script, not here. The checks run on the main process only.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from transformers import TrainerCallback

from reward_lens.integrations.alarm import HackAlarm, Reference, group_ids
from reward_lens.integrations.inputs import as_model_input, hashable_text, message_text, unhashable_text
from reward_lens.integrations.preflight import preflight
from reward_lens.integrations.signals import (
    build_concepts,
    drift_flags,
    feature_values,
    measure,
    score_batch,
)
from reward_lens.model.hooks import act_name
from reward_lens.probes.suite import DIMENSIONS

__all__ = [
    "RewardLensReward",
    "RewardLensCallback",
    "watch",
    "preflight",
    "as_model_input",
    "message_text",
    "LOG_PREFIX",
]

LOG_PREFIX = "reward_lens/"
DEFAULT_CONCEPTS = ("length", "sycophancy", "formatting", "confidence")


class RewardLensReward:
    """A TRL reward function scoring with a HookedRewardModel and recording where each batch's reward comes
    from.

    `history`: one dict per call (step, n, reward/mean, reward/std, reward_length_corr, length/mean,
    attr/<component>/mean and /std). `recent`: the last `keep` (prompt, completion) texts, the callback's
    sample pool. `last`: the last call's `BatchSignals` (per-completion terms). `seconds`: time spent here.
    """

    def __init__(
        self,
        model,
        *,
        batch_size: int = 16,
        keep: int = 256,
        name: str = "reward_lens",
        log_metrics: bool = True,
        alarm: Union[bool, HackAlarm] = True,
        features: Optional[Mapping[str, Callable[[str], float]]] = None,
        concepts: Optional[Mapping[str, Any]] = None,
        concept_layer: int = -1,
        references: Optional[Mapping[str, Reference]] = None,
        alpha: float = 0.05,
        horizon: Optional[int] = None,
    ):
        for flag, value in (("log_metrics", log_metrics), ("alarm", alarm)):
            if not isinstance(value, bool) and not (flag == "alarm" and isinstance(value, HackAlarm)):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        for label, value in (("batch_size", batch_size), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
        if getattr(model, "tokenizer", None) is None:
            raise ValueError(
                "the reward model has no tokenizer; set model.tokenizer before scoring text completions"
            )
        self.model = model
        self.batch_size = batch_size
        self.log_metrics = log_metrics
        self.__name__ = name  # TRL names the reward column after it: rewards/<name>/mean
        self.recent: deque = deque(maxlen=keep)
        self.history: List[Dict[str, Any]] = []
        self.last = None
        self.seconds = 0.0
        self.alarm_seconds = 0.0
        self.logged_via_trainer = False
        self.features = dict(features or {})
        for fname, fn in self.features.items():
            if not callable(fn):
                raise TypeError(f"feature {fname!r} must be a function completion_text -> float")
        self.concepts = {n: torch.as_tensor(v).float().reshape(-1) for n, v in (concepts or {}).items()}
        for cname, v in self.concepts.items():
            if v.numel() != model.cfg.d_model:
                raise ValueError(
                    f"concept {cname!r} has {v.numel()} values; the model's residual has {model.cfg.d_model}"
                )
        self.concept_layer = concept_layer % model.cfg.n_layers
        names = ["length", *(f"concept/{c}" for c in self.concepts), *self.features]
        if isinstance(alarm, HackAlarm):
            self.alarm: Optional[HackAlarm] = alarm
        elif alarm:
            self.alarm = HackAlarm(names, alpha=alpha, horizon=horizon, references=dict(references or {}))
        else:
            self.alarm = None

    def rewards_for(
        self, sig, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> torch.Tensor:
        """The rewards handed to the trainer, from this batch's scoring pass: the model's own. Controls and
        reward transforms (noise, shuffles, a length penalty) override this; the alarm watches what it
        returns."""
        return sig.rewards

    def feature_values(self, sig, completions: Sequence[Any]) -> Dict[str, np.ndarray]:
        """Per completion, every tracked feature (`signals.feature_values`)."""
        return feature_values(sig, completions, self.concepts, self.concept_layer, self.features)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> List[float]:
        start = time.perf_counter()
        if len(prompts) != len(completions):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(completions)} completions; TRL passes one each"
            )
        inputs = [as_model_input(p, c) for p, c in zip(prompts, completions)]
        texts_p, texts_r = [p for p, _ in inputs], [c for _, c in inputs]
        hooks = [act_name("resid_post", self.concept_layer)] if self.concepts else []
        sig = score_batch(self.model, texts_p, texts_r, batch_size=self.batch_size, resid_hooks=hooks)
        state = kwargs.get("trainer_state")
        # Completions are generated before the step that trains on them: label them with that step.
        step = state.global_step + 1 if state is not None else len(self.history) + 1
        rewards = torch.as_tensor(self.rewards_for(sig, prompts, completions, **kwargs)).float().reshape(-1)
        metrics = sig.metrics()
        if self.alarm is not None:
            t_alarm = time.perf_counter()
            values = self.feature_values(sig, completions)
            groups = group_ids([hashable_text(p) for p in texts_p])
            stats = self.alarm.update(step, rewards.numpy(), values, groups)
            metrics.update({k: float(v) for k, v in stats.items() if k != "step"})
            self.alarm_seconds += time.perf_counter() - t_alarm
        self.history.append({"step": step, "n": len(texts_p), **metrics})
        self.recent.extend((hashable_text(p), c) for p, c in inputs if isinstance(c, str))
        self.last = sig
        log_metric = kwargs.get("log_metric")
        if self.log_metrics and callable(log_metric):
            for key, value in metrics.items():
                if math.isfinite(value):
                    log_metric(LOG_PREFIX + key, value)
            self.logged_via_trainer = True
        self.seconds += time.perf_counter() - start
        return rewards.tolist()

    def sample(self, n: int, distinct_prompts: bool = False) -> Tuple[List[Any], List[str]]:
        """The `n` most recent distinct (prompt, completion) pairs with a non-empty completion text; a
        conversational prompt is its whole message list. `distinct_prompts`: at most one (the most recent)
        completion per prompt, so that a sample of GRPO's groups holds `n` prompts, not n / group size."""
        seen, prompts, out = set(), set(), []
        for pair in reversed(self.recent):
            if distinct_prompts and pair[0] in prompts:
                continue
            if pair[1].strip() and pair not in seen:
                seen.add(pair)
                prompts.add(pair[0])
                out.append(pair)
                if len(out) == n:
                    break
        out.reverse()
        return [unhashable_text(p) for p, _ in out], [r for _, r in out]


def _flat(metrics: Mapping[str, Mapping[str, Optional[float]]]) -> Dict[str, float]:
    return {LOG_PREFIX + k: v["value"] for k, v in metrics.items() if v["value"] is not None}


class RewardLensCallback(TrainerCallback):
    """Baseline and every-`every`-steps measurements of the policy's recent completions; see the module
    docstring.

    probes: hacking-probe dimensions run on the sample (None: all; () or []: none). concepts: names (a probe
    dimension gets its contrast set from the baseline sample's probe pairs; a bundled contrast set name is
    loaded) or name -> contrast; default DEFAULT_CONCEPTS. concept_layer: resid_post layer of the concept
    vectors (default: the last, where the reward is read). `trainer`: the trainer to log through (`watch`
    sets it). `log_path` is rewritten at the start of each training run. `distinct_prompts`: the sample takes
    one completion per prompt (`RewardLensReward.sample`): the intervals resample completions as
    independent, which the completions of one GRPO group are not, so with groups a sample of the latest
    completions alone holds few prompts and its intervals are too narrow.
    """

    def __init__(
        self,
        reward_fn: RewardLensReward,
        *,
        every: int = 50,
        sample_size: int = 32,
        log_path: Union[str, Path] = "reward_lens_monitor.jsonl",
        probes: Optional[Sequence[str]] = None,
        concepts: Union[None, Sequence[str], Mapping[str, Any]] = None,
        concept_layer: int = -1,
        n_boot: int = 1000,
        seed: int = 0,
        trainer: Any = None,
        distinct_prompts: bool = False,
    ):
        if not isinstance(reward_fn, RewardLensReward):
            raise TypeError(
                "reward_fn must be a RewardLensReward (the function the trainer scores with), got "
                f"{type(reward_fn).__name__}"
            )
        for flag, value in (("distinct_prompts", distinct_prompts),):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        for label, value in (("every", every), ("sample_size", sample_size), ("n_boot", n_boot)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an integer, got {value!r}")
        if every < 1 or sample_size < 4:
            raise ValueError(
                f"need every >= 1 and sample_size >= 4 (intervals need a few items), got {every}, "
                f"{sample_size}"
            )
        self.probes = list(DIMENSIONS) if probes is None else list(probes)
        unknown = [p for p in self.probes if p not in DIMENSIONS]
        if unknown:
            raise ValueError(f"unknown probe dimension(s) {unknown}; choose from {list(DIMENSIONS)}")
        self.reward_fn, self.every, self.sample_size = reward_fn, every, sample_size
        self.distinct_prompts = distinct_prompts
        self.log_path = Path(log_path)
        self.concept_spec = DEFAULT_CONCEPTS if concepts is None else concepts
        self.concept_layer, self.n_boot, self.seed, self.trainer = concept_layer, n_boot, seed, trainer
        self.baseline: Optional[Dict[str, dict]] = None
        self.records: List[dict] = []
        self.concepts: Dict[str, Any] = {}
        self._written = 0
        self._alarms_written = 0
        self._last_tick: Optional[float] = None
        self._step_times: List[float] = []

    def attach(self, trainer) -> "RewardLensCallback":
        """Log through `trainer` and register with it (`trainer.add_callback`)."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    # ------------------------------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "RewardLensCallback needs the trainer to log through: use "
                "reward_lens.integrations.trl.watch(trainer, reward_fn) or pass trainer="
            )
        self.baseline, self.records, self._written = None, [], len(self.reward_fn.history)
        self._alarms_written = 0
        alarm = self.reward_fn.alarm
        if alarm is not None:
            if alarm.horizon is None or alarm.horizon < state.max_steps:
                alarm.horizon = max(int(state.max_steps or 0), 1)  # the guarantee covers the whole run
            alarm.reset()
            self._alarms_written = 0
        self._last_tick, self._step_times = time.perf_counter(), []
        if state.is_world_process_zero:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text("")
            model = self.reward_fn.model
            self._write(
                {
                    "kind": "run",
                    "format": 2,
                    "model": getattr(model.cfg, "model_name", None),
                    "every": self.every,
                    "sample_size": self.sample_size,
                    "distinct_prompts": self.distinct_prompts,
                    "probes": self.probes,
                    "concepts": list(self.concept_spec),
                    "concept_layer": self.concept_layer % model.cfg.n_layers,
                    "alarm": None
                    if alarm is None
                    else {
                        "features": list(alarm.features),
                        "alpha": alarm.alpha,
                        "horizon": alarm.horizon,
                        "min_pressure": alarm.min_pressure,
                        "behaviour_k": alarm.k,
                        "n_perm": alarm.n_perm,
                        "scale": alarm.scale,
                        "references": {f: r.to_dict() for f, r in alarm.references.items()},
                    },
                    "time": time.time(),
                }
            )

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._last_tick is not None:
            self._step_times.append(now - self._last_tick)
        if not state.is_world_process_zero:
            return
        self._flush_batches(state)
        have = len(self.reward_fn.sample(self.sample_size, self.distinct_prompts)[0])
        if self.baseline is None and have < 4 and self.distinct_prompts and state.global_step >= self.every:
            # Fewer distinct prompts than a measurement needs: never silently off. Sample completions instead,
            # and say so in the log, the page and a warning.
            self.distinct_prompts = False
            note = (
                f"distinct_prompts=True found only {have} distinct prompt(s) by step {state.global_step} (a "
                "measurement needs 4): the monitor samples the most recent completions instead; their "
                "intervals treat a group's completions as independent"
            )
            have = len(self.reward_fn.sample(self.sample_size, False)[0])
            warnings.warn(note, UserWarning, stacklevel=2)
            self._write({"kind": "note", "step": state.global_step, "text": note})
        if self.baseline is None:
            # The first full sample is the initial policy's; with small batches wait for it until step
            # `every`.
            if have >= self.sample_size or (have >= 4 and state.global_step >= self.every):
                self.check(state, "baseline")
        elif state.global_step % self.every == 0 and have >= 4:
            self.check(state, "check")
        self._last_tick = time.perf_counter()  # the next step's time excludes this check

    # ------------------------------------------------------------------------------------------ work
    def check(self, state, kind: str = "check") -> dict:
        """Measure the current sample, compare it with the baseline, log and write the record."""
        start = time.perf_counter()
        prompts, responses = self.reward_fn.sample(self.sample_size, self.distinct_prompts)
        model = self.reward_fn.model
        extra = {}
        if kind == "baseline":
            self.concepts, cosines = build_concepts(
                model,
                self.concept_spec,
                prompts,
                responses,
                self.concept_layer,
                batch_size=self.reward_fn.batch_size,
            )
            extra["concept_cosines"] = cosines
        metrics = measure(
            model,
            prompts,
            responses,
            probes=self.probes,
            concepts=self.concepts,
            concept_layer=self.concept_layer,
            n_boot=self.n_boot,
            seed=self.seed,
            batch_size=self.reward_fn.batch_size,
        )
        flags = drift_flags(metrics, self.baseline) if self.baseline is not None else []
        if kind == "baseline":
            self.baseline = metrics
        cost = time.perf_counter() - start
        step_s = sum(self._step_times) / len(self._step_times) if self._step_times else None
        self._step_times = []
        record = {
            "kind": kind,
            "step": state.global_step,
            "n": len(prompts),
            "metrics": metrics,
            "flags": flags,
            "cost_s": cost,
            "mean_step_s": step_s,
            "overhead": cost / (self.every * step_s) if step_s else None,
            **extra,
            "time": time.time(),
        }
        self.records.append(record)
        self._write(record)
        flat = _flat(metrics)
        flat.update({LOG_PREFIX + "drift_flags": float(len(flags)), LOG_PREFIX + "check_cost_s": cost})
        self._log(flat)
        return record

    def _flush_batches(self, state) -> None:
        """The reward function's per-batch records since the last step, to the JSONL (and to the trainer's
        log when the trainer did not pass TRL's `log_metric`)."""
        new = self.reward_fn.history[self._written :]
        self._written = len(self.reward_fn.history)
        alarm = self.reward_fn.alarm
        if alarm is not None:
            for a in alarm.alarms[self._alarms_written :]:
                self._write(
                    {
                        "kind": "alarm",
                        **a,
                        "threshold": alarm.threshold(a["channel"].replace("hack", "pressure")),
                    }
                )
            self._alarms_written = len(alarm.alarms)
        for rec in new:
            self._write(
                {
                    "kind": "batch",
                    **{
                        k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                        for k, v in rec.items()
                    },
                }
            )
        if new and not self.reward_fn.logged_via_trainer:
            last = new[-1]
            self._log(
                {
                    LOG_PREFIX + k: v
                    for k, v in last.items()
                    if k not in ("step", "n") and isinstance(v, float) and math.isfinite(v)
                }
            )

    def _log(self, logs: Dict[str, float]) -> None:
        # transformers.Trainer.log itself (not a subclass override: GRPO's would flush and average its own
        # pending metrics into this entry): it appends to state.log_history and calls every callback's
        # on_log, which is how report_to backends (TensorBoard, W&B, ...) receive values.
        # The callback handler's on_log clears control.should_log: keep the trainer's own logging of this
        # step.
        from transformers import Trainer

        control = self.trainer.control
        should_log = control.should_log
        Trainer.log(self.trainer, dict(logs))
        self.trainer.control.should_log = should_log or control.should_log

    def _write(self, record: dict) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def watch(trainer, reward_fn: RewardLensReward, **kwargs: Any) -> RewardLensCallback:
    """Add a `RewardLensCallback` for `reward_fn` to `trainer`, logging through it; kwargs as the
    callback's."""
    return RewardLensCallback(reward_fn, **kwargs).attach(trainer)
