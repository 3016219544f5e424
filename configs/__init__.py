"""The Hydra config tree (YAML), shipped inside the package so that an installed mpt-run finds it
as `pkg://configs`. The defaults themselves live in runner/config.py's dataclasses; these files
hold presets and deltas only."""
