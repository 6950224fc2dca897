"""KV-cache pages: the device-side cache pytree, the host-side allocator and the prefix cache over it."""
from jaxserve.cache.host_tier import HostTier, check_kv_options
from jaxserve.cache.kv_cache import (
                                    KV_CACHE_DTYPES,
                                    SCRATCH_PAGE,
                                    Int8Pages,
                                    bytes_per_page,
                                    check_kv_cache_dtype,
                                    init_kv_cache,
                                    num_pages_for_budget,
)
from jaxserve.cache.page_allocator import OutOfPages, PageAllocator, pages_needed
from jaxserve.cache.prefix_cache import PrefixCache, page_keys

__all__ = ["KV_CACHE_DTYPES", "SCRATCH_PAGE", "Int8Pages", "bytes_per_page", "check_kv_cache_dtype", "init_kv_cache",
           "num_pages_for_budget", "HostTier", "check_kv_options", "OutOfPages", "PageAllocator",
           "pages_needed", "PrefixCache", "page_keys"]
