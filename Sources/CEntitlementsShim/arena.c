#include "CEntitlementsShim.h"

#include <stdlib.h>
#include <string.h>

// Under AddressSanitizer every allocation gets its own malloc'd chunk, exactly sized, so
// that ASan's redzones catch an overflow of any single string or struct (a shared bump
// block would hide it), and LeakSanitizer sees each one.
#if defined(__SANITIZE_ADDRESS__)
#define ENT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ENT_ASAN 1
#endif
#endif

#define ENT_ALIGN 8u
#define ENT_HEADER sizeof(size_t)
#define ENT_MIN_CHUNK 16384u
#define ENT_THREAD_BLOCK 16384u

typedef struct {
    ent_arena arena;
    int in_use;
    _Alignas(16) uint8_t block[ENT_THREAD_BLOCK];
} ent_thread_arena;

// One per thread, reused by every decode and encode on that thread. Decoding never calls
// back into Swift, so an arena is never needed twice at once on a thread; the in_use flag
// makes that safe anyway.
static _Thread_local ent_thread_arena ent_this_thread;

struct ent_arena_chunk {
    ent_arena_chunk *next;
    size_t padding; // keeps the data that follows 16-byte aligned
};

static void *ent_protobuf_alloc(void *data, size_t size) {
    return ent_arena_alloc((ent_arena *)data, size);
}

static void ent_protobuf_free(void *data, void *pointer) {
    // Individual frees are no-ops: the whole arena is released at once.
    (void)data;
    (void)pointer;
}

static size_t ent_round_up(size_t size) {
    return (size + (ENT_ALIGN - 1)) & ~(size_t)(ENT_ALIGN - 1);
}

void ent_arena_init(ent_arena *arena, void *initial, size_t initial_size, size_t limit) {
    arena->allocator.alloc = ent_protobuf_alloc;
    arena->allocator.free = ent_protobuf_free;
    arena->allocator.allocator_data = arena;
    // Align the start of the initial block; the header of the first allocation goes there.
    uintptr_t start = (uintptr_t)initial;
    uintptr_t aligned = (start + (ENT_ALIGN - 1)) & ~(uintptr_t)(ENT_ALIGN - 1);
    if (initial == NULL || initial_size < aligned - start) {
        arena->cursor = NULL;
        arena->end = NULL;
    } else {
        arena->cursor = (uint8_t *)aligned;
        arena->end = (uint8_t *)start + initial_size;
    }
    arena->chunks = NULL;
    arena->used = 0;
    arena->limit = limit;
    arena->exhausted = 0;
    arena->heap_allocated = 0;
}

ent_arena *ent_arena_acquire(size_t limit) {
    ent_thread_arena *local = &ent_this_thread;
    if (!local->in_use) {
        local->in_use = 1;
        ent_arena_init(&local->arena, local->block, sizeof(local->block), limit);
        return &local->arena;
    }
    ent_arena *arena = malloc(sizeof(ent_arena));
    if (arena == NULL) {
        return NULL;
    }
    ent_arena_init(arena, NULL, 0, limit);
    arena->heap_allocated = 1;
    return arena;
}

void ent_arena_finish(ent_arena *arena) {
    ent_arena_release(arena);
    if (arena->heap_allocated) {
        free(arena);
    } else {
        ent_this_thread.in_use = 0;
    }
}

void *ent_arena_alloc(ent_arena *arena, size_t size) {
    if (size > arena->limit - ENT_HEADER - (ENT_ALIGN - 1)) {
        arena->exhausted = 1;
        return NULL;
    }
    size_t needed = ENT_HEADER + ent_round_up(size);
    if (arena->used > arena->limit || needed > arena->limit - arena->used) {
        arena->exhausted = 1;
        return NULL;
    }
#ifdef ENT_ASAN
    ent_arena_chunk *exact = malloc(sizeof(ent_arena_chunk) + ENT_HEADER + size);
    if (exact == NULL) {
        return NULL;
    }
    exact->next = arena->chunks;
    arena->chunks = exact;
    arena->used += needed;
    size_t *exact_header = (size_t *)(exact + 1);
    *exact_header = size;
    return exact_header + 1;
#endif
    if (arena->cursor == NULL || (size_t)(arena->end - arena->cursor) < needed) {
        size_t chunk_size = needed > ENT_MIN_CHUNK ? needed : ENT_MIN_CHUNK;
        ent_arena_chunk *chunk = malloc(sizeof(ent_arena_chunk) + chunk_size);
        if (chunk == NULL) {
            return NULL;
        }
        chunk->next = arena->chunks;
        arena->chunks = chunk;
        arena->cursor = (uint8_t *)(chunk + 1);
        arena->end = arena->cursor + chunk_size;
    }
    size_t *header = (size_t *)arena->cursor;
    *header = size;
    arena->cursor += needed;
    arena->used += needed;
    return header + 1;
}

void ent_arena_release(ent_arena *arena) {
    ent_arena_chunk *chunk = arena->chunks;
    while (chunk != NULL) {
        ent_arena_chunk *next = chunk->next;
        free(chunk);
        chunk = next;
    }
    arena->chunks = NULL;
    arena->cursor = NULL;
    arena->end = NULL;
}

char *ent_arena_strndup(ent_arena *arena, const char *bytes, size_t length) {
    if (length == SIZE_MAX) {
        return NULL;
    }
    char *copy = ent_arena_alloc(arena, length + 1);
    if (copy == NULL) {
        return NULL;
    }
    if (length > 0) {
        memcpy(copy, bytes, length);
    }
    copy[length] = '\0';
    return copy;
}

static _Thread_local int tolerating_unknown_enums;

int ent_tolerating_unknown_enums(void) {
    return tolerating_unknown_enums;
}

void ent_set_tolerating_unknown_enums(int on) {
    tolerating_unknown_enums = on;
}
