"""The start of `cadence bench`: a load client for TGI's /generate_stream and a driver
that compares batching modes on one workload."""
