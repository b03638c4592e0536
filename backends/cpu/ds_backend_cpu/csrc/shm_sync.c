/* Flags in a shared-memory segment with acquire/release ordering, for ds_backend_cpu.shm.
 *
 * A rank writes its data, then publishes a counter with a release store; a peer acquires the
 * counter and only then reads the data. Python cannot express either ordering on every
 * architecture, so these functions are the whole of the compiled part.
 *
 * Waiting spins briefly (a peer running on another core is usually microseconds behind), then
 * sleeps in the kernel on the counter's futex, so a waiting rank gives its core away and is
 * woken the moment the peer publishes: on an oversubscribed host a polling sleep would add a
 * scheduler tick per step instead. A publish therefore also wakes the futex (one syscall).
 * The wait returns after `slice_s` seconds so the caller can check peers' liveness and its
 * own deadline between slices.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#define DS_HAVE_FUTEX 1
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The 32 low-order bits of a counter: what the futex compares. */
static inline uint32_t *low_word(uint64_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)p + 1;
#else
    return (uint32_t *)p;
#endif
}

/* Publish `value` into base[index]. base[index + sleepers] counts peers asleep on it: the
 * wake-up syscall (which on a busy host may hand our core to the woken peer) is made only
 * when one is. Store-fence-load here against increment-fence-load in the waiter: at least
 * one side sees the other's write, so a wake-up is never lost. */
void ds_shm_store(uint64_t *base, int64_t index, uint64_t value, int64_t sleepers) {
    __atomic_store_n(base + index, value, __ATOMIC_SEQ_CST);
#ifdef DS_HAVE_FUTEX
    if (__atomic_load_n(base + index + sleepers, __ATOMIC_SEQ_CST) != 0) {
        /* Shared (not FUTEX_PRIVATE) futex: the waiters are other processes. */
        syscall(SYS_futex, low_word(base + index), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
#else
    (void)sleepers;
#endif
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
                        double slice_s, int64_t sleepers) {
    double deadline = now_s() + slice_s;
    for (int64_t i = 0; i < n; i++) {
        uint64_t *word = base + indices[i];
        for (int spin = 0; spin < 256; spin++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) break;
            cpu_relax();
        }
        for (;;) {
            uint64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (seen >= target) break;
            double left = deadline - now_s();
            if (left <= 0.0) return i;
#ifdef DS_HAVE_FUTEX
            struct timespec ts;
            ts.tv_sec = (time_t)left;
            ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
            __atomic_add_fetch(word + sleepers, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == seen) {
                /* Sleeps only while the low word still equals what we saw. */
                syscall(SYS_futex, low_word(word), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
            }
            __atomic_sub_fetch(word + sleepers, 1, __ATOMIC_SEQ_CST);
#else
            struct timespec ts = {0, 20000};
            nanosleep(&ts, 0);
#endif
        }
    }
    return -1;
}

#ifdef __cplusplus
}
#endif
