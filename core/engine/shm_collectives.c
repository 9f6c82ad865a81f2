/* The synchronisation of srv.engine.shm_collectives: each rank's sequence number on its own cache
 * line of a shared segment, stored with release and read with acquire ordering, so that a rank
 * that sees another's number also sees the data that rank wrote before it. */
#include <stdint.h>
#include <time.h>

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Rank `rank` has finished the operation numbered `seq`. */
void srv_shm_publish(char *base, int64_t rank, int64_t seq) {
    __atomic_store_n((int64_t *)(base + 64 * rank), seq, __ATOMIC_RELEASE);
}

/* Wait until ranks [first, last) have each published `seq` or later: spinning for a while (the
 * other rank is usually a few microseconds away), then sleeping ever longer, up to a millisecond
 * (an idle server's ranks wait for the next batch this way). Returns 0, or -1 once `timeout`
 * seconds have passed (a negative timeout waits for ever). */
int srv_shm_wait(const char *base, int64_t first, int64_t last, int64_t seq, double timeout) {
    long spins = 0, sleep_ns = 0;
    double started = -1.0;
    for (int64_t rank = first; rank < last; rank++) {
        const int64_t *counter = (const int64_t *)(base + 64 * rank);
        while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < seq) {
            if (++spins < 20000) {
                cpu_pause();
                continue;
            }
            if (started < 0)
                started = seconds();
            else if (timeout >= 0 && seconds() - started > timeout)
                return -1;
            sleep_ns = sleep_ns == 0 ? 10000 : (sleep_ns >= 500000 ? 1000000 : 2 * sleep_ns);
            struct timespec pause = {0, sleep_ns};
            nanosleep(&pause, 0);
        }
    }
    return 0;
}
