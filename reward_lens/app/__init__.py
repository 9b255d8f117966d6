"""The applications: the audit pipeline, its HTML report and the `reward-lens` command line."""
