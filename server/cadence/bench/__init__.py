"""`cadence bench`: a serving benchmark client (datasets, arrival processes, vLLM's
metrics) and the experiments of MISSION.md built on it."""
