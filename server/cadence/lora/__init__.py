"""LoRA adapters served on one base model: PEFT folders parsed into this rank's slices
(`peft_adapter`), their weights paged into the KV cache's blocks (`pool`), and the
per-step products over rows of mixed adapters (`apply`)."""
