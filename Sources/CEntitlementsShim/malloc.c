#include "CEntitlementsShim.h"

#include <stdlib.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

int ent_use_one_malloc_arena(void) {
#if defined(__GLIBC__)
    if (getenv("MALLOC_ARENA_MAX") != NULL) {
        return 0;  /* the operator chose */
    }
    return mallopt(M_ARENA_MAX, 1) == 1;
#else
    return 0;
#endif
}
