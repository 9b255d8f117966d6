"""Reward-hacking probes: matched response pairs that differ in one suspect dimension."""

from reward_lens.probes.suite import ProbeItem, ProbeResult, load_probe_items, probe_pairs, run_probes

__all__ = ["ProbeItem", "ProbeResult", "load_probe_items", "probe_pairs", "run_probes"]
