// A bump arena for protobuf-c, so that unpacking a message costs no malloc per field.
//
// protobuf-c allocates every string, array and sub-message of an unpacked message through
// a ProtobufCAllocator. This one hands out memory from a caller-provided block (typically
// on the Swift stack) and from malloc'd chunks once that is used up; nothing is freed one
// by one, everything is released by ent_arena_release. A limit caps the total, so a small
// hostile message cannot make the decoder allocate without bound.
//
// Every allocation is preceded by its size. That lets the Swift side recover the exact
// length protobuf-c copied for a string (it allocates length + 1 and NUL-terminates), and
// so detect strings with an embedded NUL byte, which a C string would silently truncate.
#ifndef C_ENTITLEMENTS_SHIM_H
#define C_ENTITLEMENTS_SHIM_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ent_arena_chunk ent_arena_chunk;

typedef struct ent_arena {
    /// Pass &arena->allocator to protobuf-c; its allocator_data points back at the arena.
    ProtobufCAllocator allocator;
    uint8_t *cursor;
    uint8_t *end;
    /// malloc'd chunks, newest first; freed by ent_arena_release.
    ent_arena_chunk *chunks;
    /// Bytes handed out so far, headers included.
    size_t used;
    /// The most ent_arena_alloc will hand out in total; beyond it, it returns NULL.
    size_t limit;
    /// Set when an allocation was refused because of the limit (not because malloc failed).
    int exhausted;
    /// Set when the arena struct itself was malloc'd by ent_arena_acquire.
    int heap_allocated;
} ent_arena;

/// Takes this thread's arena, whose first 16 KiB block is thread-local memory allocated
/// once per thread, so a typical message costs no malloc at all. If this thread's arena is
/// already taken, returns a malloc'd arena instead; NULL only if that malloc fails.
/// Give it back with ent_arena_finish on the same thread.
ent_arena *ent_arena_acquire(size_t limit);

/// Releases everything `arena` allocated and returns it to its thread (or frees it).
void ent_arena_finish(ent_arena *arena);

/// Prepares an arena over `initial` (may be NULL with size 0).
void ent_arena_init(ent_arena *arena, void *initial, size_t initial_size, size_t limit);

/// Returns 8-byte aligned memory for `size` bytes, or NULL past the limit or when malloc fails.
void *ent_arena_alloc(ent_arena *arena, size_t size);

/// Frees every chunk the arena malloc'd. The arena must be initialised again before reuse.
void ent_arena_release(ent_arena *arena);

/// Copies `length` bytes and a terminating NUL into the arena; NULL when out of memory.
char *ent_arena_strndup(ent_arena *arena, const char *bytes, size_t length);

/// The number of bytes that were requested for `pointer`, an allocation of this arena.
static inline size_t ent_arena_allocation_size(const void *pointer) {
    return ((const size_t *)pointer)[-1];
}

/// Returns freed heap pages to the system (glibc's malloc_trim); a no-op elsewhere. The
/// store calls it after compaction drops the overlay of written customers.
#if defined(__GLIBC__)
#include <malloc.h>
static inline void ent_release_free_memory(void) {
    malloc_trim(0);
}
#else
static inline void ent_release_free_memory(void) {}
#endif

/* Asks the CPU to start loading the cache line at `address` without waiting for it (no
 * fault if the address is bad). The cache's batch lookups issue these for every key first,
 * so that their memory misses overlap instead of following one another. */
static inline void ent_prefetch(const void *address) {
    __builtin_prefetch(address);
}

/* Makes every thread allocate from glibc's one main malloc arena, unless the environment
 * sets MALLOC_ARENA_MAX (the operator's choice wins). Returns 1 if it did, 0 otherwise (and
 * elsewhere than glibc). Call it before other threads start: glibc gives each thread that
 * allocates its own arena, and memory freed on another thread goes back to the arena it
 * came from, where the freeing thread never reuses it. The cache's answers are made on
 * one thread (warm-up, cold reads) and evicted on another (the loop), so with an arena per
 * thread both kept their high-water mark: 144 MiB peak instead of 103 MiB at p5. */
int ent_use_one_malloc_arena(void);

/* Whether enum values this build does not know decode as the value numbered 0 on this
 * thread (a client reading a newer server's answers) instead of failing the decode (a
 * server reading requests). Set around one decode; thread-local, so decodes on other
 * threads are unaffected. */
int ent_tolerating_unknown_enums(void);
void ent_set_tolerating_unknown_enums(int on);

/* pread that never waits for the disk: preadv2 with RWF_NOWAIT (Linux 4.14 and later).
 * Returns the bytes read (fewer than asked when only part is in memory), or -1 with errno
 * EAGAIN when the data is not in the page cache; EOPNOTSUPP or ENOSYS where the file
 * system or kernel cannot say (callers then treat the read as one that would wait). */
#include <sys/types.h>
ssize_t ent_pread_nowait(int fd, void *buffer, size_t count, long long offset);

#endif
