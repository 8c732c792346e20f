"""LoRA: the adapter converter and its exports (merged, or a PEFT adapter folder)."""
