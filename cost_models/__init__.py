"""Pricing of parallel plans: compute, memory, communication and the pipeline schedule.

No torch.distributed here: the cost model runs on a laptop in milliseconds.
"""
