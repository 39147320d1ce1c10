#define _GNU_SOURCE
#include "CEntitlementsShim.h"

#include <errno.h>
#include <sys/uio.h>

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

ssize_t ent_pread_nowait(int fd, void *buffer, size_t count, long long offset) {
#if defined(__linux__)
    struct iovec vector = {.iov_base = buffer, .iov_len = count};
    return preadv2(fd, &vector, 1, (off_t)offset, RWF_NOWAIT);
#else
    (void)fd; (void)buffer; (void)count; (void)offset;
    errno = EAGAIN;
    return -1;
#endif
}
