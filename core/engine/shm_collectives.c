/* The synchronisation of srv.engine.shm_collectives: each rank's sequence number on its own cache
 * line of a shared segment, stored with release and read with acquire ordering, so that a rank
 * that sees another's number also sees the data that rank wrote before it. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

/* One rank's view of a group's segment, shared with SharedMemoryCollectives (which keeps `seq`
 * in step for the collectives it runs itself). */
typedef struct {
    char *base;
    int64_t rank, ranks, seq, header_bytes, slot_bytes;
    double timeout;
    double native_seconds;   /* spent in srv_shm_native_all_reduce */
} ShmGroup;

/* The next operation: its number taken, once every rank has finished the last one, which read
 * the slots of this one's parity (seq % 2). Every collective of the group starts here, those
 * SharedMemoryCollectives runs in Python included. Returns 0, or -1 when a rank did not arrive
 * within the timeout. */
int srv_shm_begin(ShmGroup *g) {
    g->seq += 1;
    return srv_shm_wait(g->base, 0, g->ranks, g->seq - 1, g->timeout);
}

/* x (count floats) becomes the sum of every rank's x, in place, in pieces of a slot: each piece
 * is written to this rank's slot of the operation's parity, then summed over the slots in rank
 * order (every rank holds the same bits). Returns 0, or -1 when a rank did not arrive within the
 * timeout. */
int srv_shm_all_reduce(ShmGroup *g, float *x, int64_t count) {
    const int64_t stride = g->slot_bytes / (int64_t)sizeof(float);   /* floats a slot */
    for (int64_t start = 0; start < count; start += stride) {
        const int64_t n = count - start < stride ? count - start : stride;
        if (srv_shm_begin(g) != 0) return -1;
        const float *slots = (const float *)(g->base + g->header_bytes + (g->seq % 2) * g->ranks * g->slot_bytes);
        memcpy((float *)slots + g->rank * stride, x + start, (size_t)n * sizeof(float));
        srv_shm_publish(g->base, g->rank, g->seq);
        if (srv_shm_wait(g->base, 0, g->ranks, g->seq, g->timeout) != 0) return -1;
        /* ((slot 0 + slot 1) + slot 2) ..., a rank at a time: loops the compiler vectorizes */
        float *out = x + start;
        memcpy(out, slots, (size_t)n * sizeof(float));
        for (int64_t r = 1; r < g->ranks; r++) {
            const float *other = slots + r * stride;
            for (int64_t i = 0; i < n; i++) out[i] += other[i];
        }
    }
    return 0;
}

/* srv_shm_all_reduce as srv.sdk.native.NativeKernel's all-reduce, for C decode layers: a
 * collective that fails ends the process, as it does in the Python layers (no exception can
 * cross their C frames). */
void srv_shm_native_all_reduce(const void *context, float *x, int64_t count) {
    ShmGroup *g = (ShmGroup *)context;
    const double started = seconds();
    if (srv_shm_all_reduce(g, x, count) != 0) {
        fprintf(stderr, "rank %ld: a shared-memory all-reduce timed out in the native decode layers; exiting\n",
                (long)g->rank);
        fflush(stderr);
        _exit(1);
    }
    g->native_seconds += seconds() - started;
}
