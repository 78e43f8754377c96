"""`cadence bench`: a serving benchmark client (datasets, arrival processes, vLLM's
metrics) and the serving experiments E1-E4 built on it (docs/experiments/)."""
