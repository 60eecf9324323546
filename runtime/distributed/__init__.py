"""Tensor parallelism on torch.distributed: rank 0 decides, every rank executes the same plan.

launcher.py (rank 0: spawn workers, broadcast plans, shut down), tp_engine.py (an Engine with its
group), worker.py (ranks >= 1: follow the plans), collectives.py (timed collectives + watchdog),
messages.py (what is broadcast, plan digests, the desync check), sharding.py (column/row-parallel
weight shards), mirror_pool.py (a worker's page table), errors.py.
"""
