// bench/nvme.py's kernel asynchronous I/O path (single-threaded callers): Linux native AIO through raw syscalls
// (io_setup/io_submit/io_getevents; no libaio package needed), measured against ds_core.io's
// thread pool. One request of nbytes at offset in block-sized chunks, `depth` (<= 64) in
// flight on one thread, O_DIRECT (buffer, offset and block 4 KiB-aligned; the kernel queues
// buffered AIO synchronously). Returns 0 or -errno (-EIO for a short transfer).
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <errno.h>

static long io_setup_(unsigned n, aio_context_t *c) { return syscall(SYS_io_setup, n, c); }
static long io_submit_(aio_context_t c, long n, struct iocb **p) { return syscall(SYS_io_submit, c, n, p); }
static long io_getevents_(aio_context_t c, long mn, long mx, struct io_event *e) {
  return syscall(SYS_io_getevents, c, mn, mx, e, NULL);
}

int kaio_transfer(const char *path, int write, void *buf, int64_t nbytes, int64_t offset,
                  int64_t block, int depth) {
  if (depth < 1 || depth > 64) return -EINVAL;
  int fd = open(path, (write ? (O_WRONLY | O_CREAT) : O_RDONLY) | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return -errno;
  // One context for the process (as an engine would keep one per handle): io_destroy waits
  // for an RCU grace period, milliseconds that a per-request context would add to each call.
  static aio_context_t ctx = 0;
  if (ctx == 0 && io_setup_(64, &ctx) < 0) { int e = errno; ctx = 0; close(fd); return -e; }
  struct iocb cbs[64]; struct iocb *ptrs[64]; struct io_event ev[64];
  int64_t next = 0, done = 0; int inflight = 0, rc = 0;
  int64_t nchunks = (nbytes + block - 1) / block;
  int freelist[64]; int nfree = depth; for (int i = 0; i < depth; i++) freelist[i] = i;
  while (done < nchunks) {
    int n = 0;
    while (next < nchunks && nfree > 0) {
      int slot = freelist[--nfree];
      struct iocb *cb = &cbs[slot]; memset(cb, 0, sizeof *cb);
      int64_t s = next * block, len = nbytes - s < block ? nbytes - s : block;
      cb->aio_fildes = fd; cb->aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      cb->aio_buf = (uint64_t)(uintptr_t)((char *)buf + s); cb->aio_nbytes = len;
      cb->aio_offset = offset + s; cb->aio_data = slot;
      ptrs[n++] = cb; next++;
    }
    if (n) {
      long s = io_submit_(ctx, n, ptrs);
      if (s != n) { rc = s < 0 ? -errno : -EIO; break; }
      inflight += n;
    }
    long got = io_getevents_(ctx, 1, inflight, ev);
    if (got < 0) { rc = -errno; break; }
    for (long i = 0; i < got; i++) {
      struct iocb *cb = (struct iocb *)(uintptr_t)ev[i].obj;
      if (ev[i].res != (int64_t)cb->aio_nbytes) rc = ev[i].res < 0 ? (int)ev[i].res : -EIO;
      freelist[nfree++] = (int)ev[i].data;
    }
    inflight -= got; done += got;
    if (rc) break;
  }
  while (inflight > 0) { long got = io_getevents_(ctx, 1, inflight, ev); if (got <= 0) break; inflight -= got; }
  close(fd);
  return rc;
}
