/* Flags in a shared-memory segment with acquire/release ordering, for ds_backend_cpu.shm.
 *
 * A rank writes its data, then publishes a counter with a release store; a peer acquires the
 * counter and only then reads the data. Python cannot express either ordering on every
 * architecture, so these three functions are the whole of the compiled part. Waiting spins
 * briefly (the peer is usually a few microseconds behind), then yields, then sleeps, so an
 * oversubscribed host is not burned by waiting ranks; it returns after `slice_s` seconds
 * so the caller can check peers' liveness and its own deadline between slices.
 */
#define _POSIX_C_SOURCE 200809L
#include <sched.h>
#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

void ds_shm_store(uint64_t *base, int64_t index, uint64_t value) {
    __atomic_store_n(base + index, value, __ATOMIC_RELEASE);
}

uint64_t ds_shm_load(uint64_t *base, int64_t index) {
    return __atomic_load_n(base + index, __ATOMIC_ACQUIRE);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wait until base[indices[i]] >= target for every i < n, for at most slice_s seconds.
 * Returns -1 when all have arrived, else the position i of the first one that has not. */
int64_t ds_shm_wait_all(uint64_t *base, const int64_t *indices, int64_t n, uint64_t target,
                        double slice_s) {
    int64_t i = 0;
    uint64_t idle = 0;
    double deadline = -1.0;
    while (i < n) {
        if (__atomic_load_n(base + indices[i], __ATOMIC_ACQUIRE) >= target) {
            i++;
            continue;
        }
        idle++;
        if (idle < 2048) {
            cpu_relax();
            continue;
        }
        if (deadline < 0.0) {
            deadline = now_s() + slice_s;
        } else if (now_s() > deadline) {
            return i;
        }
        if (idle < 2048 + 256) {
            sched_yield();
        } else {
            struct timespec ts = {0, idle < 2048 + 4096 ? 5000 : 50000};
            nanosleep(&ts, 0);
        }
    }
    return -1;
}

#ifdef __cplusplus
}
#endif
