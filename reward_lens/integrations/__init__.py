"""Plug a reward model into an RL training loop and watch where its reward comes from while the policy trains.

  * `reward_lens.integrations.signals`: framework-free measurements of a batch of (prompt, response) texts:
    rewards with their exact split over embed / attention / MLP per layer, the reward-length correlation,
    concept-vector projections, hacking-probe effects, and drift flags against a baseline.
  * `reward_lens.integrations.trl`: a TRL reward function and a `TrainerCallback` built on them
    (`pip install "reward-lens[trl]"`).
  * `reward_lens.app.monitor`: a logged run (JSONL) rendered as one self-contained HTML page
    (also `reward-lens monitor LOG.jsonl`).

Nothing here is imported by `import reward_lens`, and no module here imports `trl` itself: the reward
function is a plain callable and the callback needs only `transformers`.
"""
