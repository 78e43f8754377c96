"""Speculative decoding on the shard: verification of proposed tokens (`verify`), the
load threshold reported to the router (`threshold`) and the draft model (`draft`)."""
