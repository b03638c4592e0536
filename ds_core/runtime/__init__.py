"""DeepSpeed's ``deepspeed.runtime`` import paths, for scripts that import from there."""
