/* LD_PRELOAD shim for the fio comparison: fio's --iomem=mmap buffer is an
 * anonymous mapping; this over-maps it to a 2 MiB boundary and asks for
 * transparent huge pages, as Strata's host tier does for its own buffers, so
 * that fio is measured at its best. Only anonymous mappings of 2 MiB or more
 * are touched. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>

#define HUGE (2ul << 20)

typedef void* (*mmap_fn)(void*, size_t, int, int, int, off_t);

void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  static mmap_fn real;
  if (!real) real = (mmap_fn)dlsym(RTLD_NEXT, "mmap");
  if (!(flags & MAP_ANONYMOUS) || addr || len < HUGE) return real(addr, len, prot, flags, fd, off);
  char* raw = real(NULL, len + HUGE, prot, flags, fd, off);
  if (raw == MAP_FAILED) return raw;
  uintptr_t start = (uintptr_t)raw, aligned = (start + HUGE - 1) & ~(HUGE - 1);
  if (aligned > start) munmap(raw, aligned - start);
  if (start + HUGE > aligned) munmap((void*)(aligned + len), start + HUGE - aligned);
  madvise((void*)aligned, len, MADV_HUGEPAGE);
  return (void*)aligned;
}

/* fio is built with 64-bit offsets and may call the mmap64 alias. */
void* mmap64(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  return mmap(addr, len, prot, flags, fd, off);
}
