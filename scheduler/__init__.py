"""The shared scheduler: requests, the KV block pool, the KV cache manager and the step policy.

Nothing here imports torch models or kernels: it decides which tokens of which requests run
in the next step and which KV blocks they write, and learns the sampled tokens afterwards.
"""
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.block_pool import BlockPool, KVBlock
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_cache_spec import KVCacheGroup, plan_groups
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput, EngineCoreOutput
from scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "FinishReason", "Request", "RequestStatus", "BlockPool", "KVBlock", "KVCacheManager",
    "CachedRequestData", "NewRequestData", "SchedulerOutput", "EngineCoreOutput", "Scheduler",
    "SchedulerConfig", "KVCacheGroup", "plan_groups",
]
