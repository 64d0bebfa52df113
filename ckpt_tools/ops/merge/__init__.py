"""merge-lora: a PEFT LoRA adapter folder merged into its base checkpoint, torch-free."""
