/* async_io: one file transfer (read or write of a host buffer at a file offset), split into
 * block-sized chunks over `nthreads` threads, pread/pwrite only (no libaio/liburing needed).
 * Each thread has one blocking call outstanding, so `nthreads` is also the number of blocks
 * the disk sees in flight (the caller passes queue_depth x intra_op_parallelism, capped).
 *
 * O_DIRECT is used for chunks whose file offset and length are multiples of `align`; a chunk
 * whose buffer address is not aligned goes through the thread's aligned bounce buffer; a chunk
 * whose offset or length is not aligned (a tensor's tail) goes through a second, buffered
 * descriptor. Both descriptors are closed before returning, on success or error.
 *
 * Returns 0, or a negative errno with *err_at the file offset of the failing chunk (-1: the
 * open failed), or 1 for a short read with *err_at the file offset where the file ended. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int fd_direct, fd_buf, is_write, tid, nthreads;
    char *buf;
    int64_t nbytes, offset, block, align;
    int rc;
    int64_t err_at;
} job_t;

/* Moves len bytes; after a partial direct transfer the rest goes through the buffered fd. */
static int move(job_t *j, int fd, char *p, int64_t len, int64_t off, int64_t *at) {
    int64_t done = 0;
    while (done < len) {
        ssize_t r = j->is_write ? pwrite(fd, p + done, (size_t)(len - done), (off_t)(off + done))
                                : pread(fd, p + done, (size_t)(len - done), (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            *at = off + done;
            return -errno;
        }
        if (r == 0) {
            *at = off + done;
            return j->is_write ? -EIO : 1;
        }
        done += r;
        if (done < len) fd = j->fd_buf;
    }
    return 0;
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    char *bounce = NULL;
    int64_t nchunks = (j->nbytes + j->block - 1) / j->block;
    for (int64_t c = j->tid; c < nchunks && j->rc == 0; c += j->nthreads) {
        int64_t start = c * j->block;
        int64_t len = j->nbytes - start < j->block ? j->nbytes - start : j->block;
        int64_t off = j->offset + start;
        char *p = j->buf + start;
        int rc;
        if (j->fd_direct >= 0 && off % j->align == 0 && len % j->align == 0) {
            if ((uintptr_t)p % (uintptr_t)j->align == 0) {
                rc = move(j, j->fd_direct, p, len, off, &j->err_at);
            } else {
                if (bounce == NULL && posix_memalign((void **)&bounce, (size_t)j->align,
                                                     (size_t)j->block) != 0) {
                    bounce = NULL;
                    j->rc = -ENOMEM;
                    j->err_at = off;
                    break;
                }
                if (j->is_write) memcpy(bounce, p, (size_t)len);
                rc = move(j, j->fd_direct, bounce, len, off, &j->err_at);
                if (!j->is_write && rc == 0) memcpy(p, bounce, (size_t)len);
            }
        } else {
            rc = move(j, j->fd_buf, p, len, off, &j->err_at);
        }
        if (rc != 0) j->rc = rc;
    }
    free(bounce);
    return NULL;
}

int ds_aio_transfer(const char *path, int is_write, void *buf, int64_t nbytes, int64_t offset,
                    int64_t block, int nthreads, int direct, int64_t align, int64_t *err_at) {
    int flags = is_write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    *err_at = -1;
    int fd_buf = open(path, flags | O_CLOEXEC, 0644);
    if (fd_buf < 0) return -errno;
    int fd_direct = -1;
    if (direct) {
        fd_direct = open(path, flags | O_CLOEXEC | O_DIRECT, 0644);
        if (fd_direct < 0 && errno != EINVAL) {
            int e = errno;
            close(fd_buf);
            return -e;
        }
    }
    if (nthreads < 1) nthreads = 1;
    int64_t nchunks = (nbytes + block - 1) / block;
    if (nthreads > nchunks) nthreads = nchunks > 0 ? (int)nchunks : 1;
    job_t *jobs = calloc((size_t)nthreads, sizeof(job_t));
    pthread_t *th = calloc((size_t)nthreads, sizeof(pthread_t));
    char *started = calloc((size_t)nthreads, 1);
    int rc = 0;
    if (jobs == NULL || th == NULL || started == NULL) {
        rc = -ENOMEM;
    } else {
        for (int t = 0; t < nthreads; t++) {
            jobs[t] = (job_t){fd_direct, fd_buf, is_write, t, nthreads, (char *)buf,
                              nbytes,    offset, block,    align, 0, -1};
        }
        for (int t = 1; t < nthreads; t++) {
            if (pthread_create(&th[t], NULL, worker, &jobs[t]) == 0)
                started[t] = 1;
            else
                worker(&jobs[t]); /* not started: this thread takes its chunks */
        }
        worker(&jobs[0]);
        for (int t = 1; t < nthreads; t++)
            if (started[t]) pthread_join(th[t], NULL);
        for (int t = 0; t < nthreads && rc == 0; t++) {
            if (jobs[t].rc != 0) {
                rc = jobs[t].rc;
                *err_at = jobs[t].err_at;
            }
        }
    }
    free(started);
    free(jobs);
    free(th);
    if (fd_direct >= 0 && close(fd_direct) != 0 && rc == 0) rc = -errno;
    if (close(fd_buf) != 0 && rc == 0) rc = -errno;
    return rc;
}
