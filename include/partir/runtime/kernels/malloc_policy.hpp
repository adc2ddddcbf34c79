#pragma once
// glibc serves large blocks (beyond a threshold that adapts only in the main thread's arena) with fresh
// mmap pages and unmaps them on free, so a device thread that frees its step's buffers page-faults all of
// them again next step: 2x to 8x slower steps on this machine. The backends therefore raise the mmap
// threshold to its maximum (32 MiB), keep every thread in the main arena and stop trimming the heap, once
// per process. Freed memory is kept for reuse, as every ML runtime's caching allocator does; set
// PARTIR_MALLOC_DEFAULTS=1 to leave glibc as is.
#include <cstdlib>
#include <mutex>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace partir {

inline void keep_freed_memory() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* v = std::getenv("PARTIR_MALLOC_DEFAULTS"); v && *v == '1') return;
    mallopt(M_ARENA_MAX, 1);  // per-thread arenas would still return freed pages to the kernel
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  });
#endif
}

}  // namespace partir
