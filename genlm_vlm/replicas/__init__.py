"""Replicas on Ray: :class:`ReplicaPool`, the :class:`~genlm_vlm.AsyncLM` API over N engines.

Each replica is a Ray actor holding its own :class:`~genlm_vlm.AsyncVirtualLM`; the pool routes
every query to the replica that holds its session or the longest cached prefix of it
(:mod:`.routing`), and balances new prompts by load. Ray is an optional extra
(``pip install genlm-vlm[ray]``); importing this package imports neither Ray nor vLLM.
"""

from .pool import ReplicaPool
from .routing import ReplicaDiedError, Router

__all__ = ["ReplicaDiedError", "ReplicaPool", "Router"]
