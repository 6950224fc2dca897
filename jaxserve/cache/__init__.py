"""KV-cache pages: the device-side cache pytree and the host-side allocator."""
from jaxserve.cache.kv_cache import SCRATCH_PAGE, bytes_per_page, init_kv_cache, num_pages_for_budget
from jaxserve.cache.page_allocator import OutOfPages, PageAllocator, pages_needed

__all__ = ["SCRATCH_PAGE", "bytes_per_page", "init_kv_cache", "num_pages_for_budget", "OutOfPages", "PageAllocator",
           "pages_needed"]
