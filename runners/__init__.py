"""The engine: turns a plan into process groups and modules, and trains with it (torch.distributed)."""
