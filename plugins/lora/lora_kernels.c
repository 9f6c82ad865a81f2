/* LoRA products on float32 rows, for a batch that mixes adapters: each row's adapter adds
 * scaling * (x A^T) B^T into the columns of the target it has on the layer.
 *
 * The rows are grouped by adapter (the Python side lists each group's rows), and each group is
 * cut into chunks of `chunk` rows (--max-lora-chunk-size). Two passes, each over items that
 * write disjoint memory, shared among OpenMP's threads (torch's runtime and count):
 *   shrink: t[row][k] = sum_i A[k][i] x[row][i], an item being (group, chunk, target, 4 ranks);
 *   expand: y[row][offset + j] += scaling * sum_k t[row][k] B^T[k][j], an item being
 *           (group, chunk, target, 64 columns).
 * Both inner loops run over contiguous floats (A row-major [rank][in], B transposed [rank][out]),
 * four rows at a time so each weight line read serves four rows.
 *
 * Instruction sets, picked per batch (`isa`) by the Python side from the CPU's flags: 0 portable
 * C, 1 AVX2 with FMA, 2 AVX-512. One body, compiled three times by target attributes; the
 * compiler vectorizes its fixed-width loops for each.
 *
 * srv_lora_linear is a linear kernel of srv.sdk.native (NativeKernel's linear kind): the base
 * layer's own kernel, then the adapters' products, so a model's C decode steps keep the layer.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *function;
    const void *context;
} NativeKernel;

typedef void (*LinearFunction)(const void *context, const float *x, int64_t rows, float *y);

/* One adapter's product on one target of a layer: output columns [offset, offset + columns). */
typedef struct {
    int64_t offset, columns, rank;
    float scaling;
    const float *a;  /* [rank][in_features] */
    const float *bt; /* [rank][columns] */
} LoraProduct;

/* A fused layer holds at most three targets (q, k and v). */
#define MAX_PRODUCTS 3

typedef struct {
    int64_t count;
    LoraProduct products[MAX_PRODUCTS];
} LoraSlot;

/* Which rows of a forward pass belong to which adapter. */
typedef struct {
    int64_t groups;
    const int64_t *slot;   /* [groups]: each group's adapter slot */
    const int64_t *starts; /* [groups + 1]: each group's rows in `rows` */
    const int64_t *rows;   /* row indices into x and y, group after group */
    int64_t chunk;         /* rows of a group an item covers */
    int64_t isa;
} LoraBatch;

typedef struct {
    NativeKernel base; /* function NULL: no base product (srv_lora_add adds into y as it is) */
    int64_t in_features, out_features;
    const LoraSlot *slots; /* [capacity], indexed by adapter slot */
    const LoraBatch *batch;
} LoraLayer;

#define ROWS 4
#define RANKS 4
#define LANES 16
#define COLUMNS 64

/* LANES floats as one value (GCC's vector extension): the compiler splits it into the widest
 * registers the target has, so one loop serves every instruction set. Loaded unaligned. */
typedef float Lanes __attribute__((vector_size(LANES * sizeof(float))));
typedef float LanesUnaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

#define LOAD(p) (*(const LanesUnaligned *)(p))

typedef struct {
    int64_t group, first, count; /* rows [first, first + count) of the group */
    int64_t product, block;      /* the target, and the block of ranks or columns */
    float *t;                    /* the group's t rows for this target: [group rows][rank] */
} Item;

static inline __attribute__((always_inline)) void shrink(const LoraLayer *layer, const Item *item, const float *x) {
    const LoraBatch *b = layer->batch;
    const LoraProduct *p = &layer->slots[b->slot[item->group]].products[item->product];
    const int64_t in = layer->in_features, rank = p->rank, body = in - in % LANES;
    const int64_t *rows = b->rows + b->starts[item->group];
    const int64_t k0 = item->block * RANKS, k1 = k0 + RANKS < rank ? k0 + RANKS : rank;
    const int64_t end = item->first + item->count;
    for (int64_t r0 = item->first; r0 < end; r0 += ROWS) {
        const int64_t n = end - r0 < ROWS ? end - r0 : ROWS;
        const float *xr[ROWS];
        for (int64_t r = 0; r < ROWS; r++) xr[r] = x + rows[r0 + (r < n ? r : 0)] * in;
        for (int64_t k = k0; k < k1; k++) {
            const float *a = p->a + k * in;
            Lanes lanes[ROWS] = {0};
            for (int64_t i = 0; i < body; i += LANES) {
                const Lanes weights = LOAD(a + i);
                for (int64_t r = 0; r < ROWS; r++) lanes[r] += weights * LOAD(xr[r] + i);
            }
            for (int64_t r = 0; r < n; r++) {
                float sum = 0.0f;
                for (int64_t l = 0; l < LANES; l++) sum += lanes[r][l];
                for (int64_t i = body; i < in; i++) sum += a[i] * xr[r][i];
                item->t[(r0 + r) * rank + k] = sum;
            }
        }
    }
}

static inline __attribute__((always_inline)) void expand(const LoraLayer *layer, const Item *item, float *y) {
    const LoraBatch *b = layer->batch;
    const LoraProduct *p = &layer->slots[b->slot[item->group]].products[item->product];
    const int64_t out = layer->out_features, rank = p->rank;
    const int64_t *rows = b->rows + b->starts[item->group];
    const int64_t j0 = item->block * COLUMNS, j1 = j0 + COLUMNS < p->columns ? j0 + COLUMNS : p->columns;
    const int64_t end = item->first + item->count;
    for (int64_t r0 = item->first; r0 < end; r0 += ROWS) {
        const int64_t n = end - r0 < ROWS ? end - r0 : ROWS;
        float tk[ROWS];
        for (int64_t j = j0; j < j1; j += LANES) {
            const int64_t width = j1 - j < LANES ? j1 - j : LANES;
            Lanes acc[ROWS] = {0};
            if (width == LANES) {
                for (int64_t k = 0; k < rank; k++) {
                    const Lanes weights = LOAD(p->bt + k * p->columns + j);
                    for (int64_t r = 0; r < ROWS; r++) tk[r] = item->t[(r0 + (r < n ? r : 0)) * rank + k];
                    for (int64_t r = 0; r < ROWS; r++) acc[r] += tk[r] * weights;
                }
            } else {
                for (int64_t k = 0; k < rank; k++) {
                    const float *bt = p->bt + k * p->columns + j;
                    for (int64_t r = 0; r < n; r++)
                        for (int64_t l = 0; l < width; l++) acc[r][l] += item->t[(r0 + r) * rank + k] * bt[l];
                }
            }
            for (int64_t r = 0; r < n; r++) {
                float *yr = y + rows[r0 + r] * out + p->offset + j;
                for (int64_t l = 0; l < width; l++) yr[l] += p->scaling * acc[r][l];
            }
        }
    }
}

/* The batch's items: shrink items first, then expand items, each pass's count returned. */
static int64_t list_items(const LoraLayer *layer, float *t, Item *items, int64_t *shrinks) {
    const LoraBatch *b = layer->batch;
    int64_t count = 0, expand_count = 0;
    /* Shrink items, then expand items after them (two passes over the same list). */
    for (int pass = 0; pass < 2; pass++) {
        float *scratch = t;
        for (int64_t g = 0; g < b->groups; g++) {
            const LoraSlot *slot = &layer->slots[b->slot[g]];
            const int64_t size = b->starts[g + 1] - b->starts[g];
            for (int64_t q = 0; q < slot->count; q++) {
                const LoraProduct *p = &slot->products[q];
                const int64_t blocks = pass == 0 ? (p->rank + RANKS - 1) / RANKS : (p->columns + COLUMNS - 1) / COLUMNS;
                for (int64_t first = 0; first < size; first += b->chunk)
                    for (int64_t block = 0; block < blocks; block++) {
                        Item *item = &items[count++];
                        item->group = g, item->first = first, item->product = q, item->block = block, item->t = scratch;
                        item->count = size - first < b->chunk ? size - first : b->chunk;
                    }
                scratch += size * p->rank;
            }
        }
        if (pass == 0) *shrinks = count;
        else expand_count = count - *shrinks;
    }
    return expand_count;
}

/* Upper bounds of the items and t floats of a batch on a layer. */
static void sizes(const LoraLayer *layer, int64_t *items, int64_t *floats, int64_t *work) {
    const LoraBatch *b = layer->batch;
    *items = *floats = *work = 0;
    for (int64_t g = 0; g < b->groups; g++) {
        const LoraSlot *slot = &layer->slots[b->slot[g]];
        const int64_t size = b->starts[g + 1] - b->starts[g], chunks = (size + b->chunk - 1) / b->chunk;
        for (int64_t q = 0; q < slot->count; q++) {
            const LoraProduct *p = &slot->products[q];
            *items += chunks * ((p->rank + RANKS - 1) / RANKS + (p->columns + COLUMNS - 1) / COLUMNS);
            *floats += size * p->rank;
            *work += size * p->rank * (layer->in_features + p->columns);
        }
    }
}

#define LORA_ADD(name, target)                                                                      \
    target static void name(const LoraLayer *layer, const Item *items, int64_t shrinks, int64_t expands, \
                            const float *x, float *y, int parallel) {                               \
        _Pragma("omp parallel if (parallel)")                                                        \
        {                                                                                            \
            _Pragma("omp for schedule(dynamic)")                                                     \
            for (int64_t i = 0; i < shrinks; i++) shrink(layer, &items[i], x);                       \
            _Pragma("omp for schedule(dynamic)")                                                     \
            for (int64_t i = 0; i < expands; i++) expand(layer, &items[shrinks + i], y);             \
        }                                                                                            \
    }

LORA_ADD(add_portable, )
LORA_ADD(add_avx2, __attribute__((target("avx2,fma"))))
LORA_ADD(add_avx512, __attribute__((target("avx512f,avx2,fma"))))

/* Below this many multiply-adds a layer, one thread does it all (a fork costs more). */
#define PARALLEL_WORK 65536

/* y [rows][out_features] += each batch row's adapter's products of x [rows][in_features]. */
void srv_lora_add(const LoraLayer *layer, const float *x, float *y) {
    const LoraBatch *b = layer->batch;
    if (b->groups == 0) return;
    int64_t item_count, floats, work, shrinks = 0;
    sizes(layer, &item_count, &floats, &work);
    if (item_count == 0) return;
    Item *items = malloc((size_t)item_count * sizeof(Item));
    float *t = malloc((size_t)floats * sizeof(float));
    const int64_t expands = list_items(layer, t, items, &shrinks);
    const int parallel = work >= PARALLEL_WORK;
    if (b->isa == 2) add_avx512(layer, items, shrinks, expands, x, y, parallel);
    else if (b->isa == 1) add_avx2(layer, items, shrinks, expands, x, y, parallel);
    else add_portable(layer, items, shrinks, expands, x, y, parallel);
    free(t);
    free(items);
}

/* A linear kernel (srv.sdk.native): the base layer's product, then the batch's adapters'. */
void srv_lora_linear(const void *context, const float *x, int64_t rows, float *y) {
    const LoraLayer *layer = context;
    ((LinearFunction)layer->base.function)(layer->base.context, x, rows, y);
    srv_lora_add(layer, x, y);
}
