"""The example trainer: a small GPT on bundled text, data-parallel over torch.distributed."""
