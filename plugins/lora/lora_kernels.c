/* LoRA products on float32 rows, for a batch that mixes adapters: each row's adapter adds
 * scaling * (x A^T) B^T into the columns of the target it has on the layer.
 *
 * The rows are grouped by adapter (the Python side lists each group's rows), and each group is
 * cut into chunks of `chunk` rows (--max-lora-chunk-size). Two passes, each over items that
 * write disjoint memory, shared among OpenMP's threads (torch's runtime and count):
 *   shrink: t[row][k] = sum_i x[row][i] A^T[i][k], an item being (group, chunk, target,
 *           RANK_BLOCK ranks);
 *   expand: y[row][offset + j] += scaling * sum_k t[row][k] B^T[k][j], an item being
 *           (group, chunk, target, COLUMNS columns).
 * Both are outer products: a row's value, broadcast, times a vector of weights, so no sum ever
 * runs across a vector's lanes, and each weight vector read serves a tile of rows. The weights are
 * laid out in the order the passes read them, each item's in one contiguous run:
 *   A^T [in][ranks padded to LANES], B^T in blocks of COLUMNS columns [blocks][rank][COLUMNS],
 *   the padding zeros.
 *
 * Instruction sets, picked per batch (`isa`) by the Python side from the CPU's flags: 0 portable
 * C, 1 AVX2 with FMA, 2 AVX-512. One body (the end of this file, which includes itself once per
 * instruction set) written on GCC's vector extension, each time with the set's own register
 * width and tile shapes that fit its registers. The width must be the set's own: a vector wider
 * than the target's registers has no machine mode, so every operation on it goes through memory.
 *
 * srv_lora_linear is a linear kernel of srv.sdk.native (NativeKernel's linear kind): the base
 * layer's own kernel, then the adapters' products, so a model's C decode steps keep the layer.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef LORA_BODY

typedef struct {
    const void *function;
    const void *context;
} NativeKernel;

typedef void (*LinearFunction)(const void *context, const float *x, int64_t rows, float *y);

/* One adapter's product on one target of a layer: output columns [offset, offset + columns). */
typedef struct {
    int64_t offset, columns, rank;
    float scaling;
    int64_t bf16;    /* the weights are bfloat16 (else float32) */
    const void *at;  /* [in_features][padded rank] */
    const void *bt;  /* [column blocks][rank][COLUMNS] */
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
    int64_t parallel_work; /* the multiply-adds a layer from which OpenMP's threads share it */
} LoraBatch;

typedef struct {
    NativeKernel base; /* function NULL: no base product (srv_lora_add adds into y as it is) */
    int64_t in_features, out_features;
    const LoraSlot *slots; /* [capacity], indexed by adapter slot */
    const LoraBatch *batch;
} LoraLayer;

/* The layout's units, multiples of every body's vector width: */
#define PAD 16            /* A^T's ranks are padded to a multiple of it */
#define RANK_BLOCK 32     /* ranks a shrink item computes */
#define COLUMNS 64        /* columns an expand item computes (B^T's block) */
#define MAX_TILE_ROWS 4

static inline int64_t padded_rank(int64_t rank) { return (rank + PAD - 1) / PAD * PAD; }

/* bfloat16 values are float32's top halves: widening is a shift, narrowing rounds to nearest
 * even (torch's rounding; a NaN stays a NaN). */
static inline __attribute__((always_inline)) float widen(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

typedef struct {
    int64_t group, first, count; /* rows [first, first + count) of the group */
    int64_t product, block;      /* the target, and the block of ranks or columns */
    float *t;                    /* the group's t rows for this target: [group rows][padded rank] */
} Item;

static inline const LoraProduct *product_of(const LoraLayer *layer, const Item *item) {
    return &layer->slots[layer->batch->slot[item->group]].products[item->product];
}

/* The batch's items: shrink items first, then expand items, each pass's count returned. */
static int64_t list_items(const LoraLayer *layer, float *t, Item *items, int64_t *shrinks) {
    const LoraBatch *b = layer->batch;
    int64_t count = 0, expand_count = 0;
    for (int pass = 0; pass < 2; pass++) {
        float *scratch = t;
        for (int64_t g = 0; g < b->groups; g++) {
            const LoraSlot *slot = &layer->slots[b->slot[g]];
            const int64_t size = b->starts[g + 1] - b->starts[g];
            for (int64_t q = 0; q < slot->count; q++) {
                const LoraProduct *p = &slot->products[q];
                const int64_t blocks = pass == 0 ? (p->rank + RANK_BLOCK - 1) / RANK_BLOCK
                                                 : (p->columns + COLUMNS - 1) / COLUMNS;
                for (int64_t first = 0; first < size; first += b->chunk)
                    for (int64_t block = 0; block < blocks; block++) {
                        Item *item = &items[count++];
                        item->group = g, item->first = first, item->product = q, item->block = block, item->t = scratch;
                        item->count = size - first < b->chunk ? size - first : b->chunk;
                    }
                scratch += size * padded_rank(p->rank);
            }
        }
        if (pass == 0) *shrinks = count;
        else expand_count = count - *shrinks;
    }
    return expand_count;
}

/* Upper bounds of the items and t floats of a batch on a layer, and its multiply-adds. */
static void sizes(const LoraLayer *layer, int64_t *items, int64_t *floats, int64_t *work) {
    const LoraBatch *b = layer->batch;
    *items = *floats = *work = 0;
    for (int64_t g = 0; g < b->groups; g++) {
        const LoraSlot *slot = &layer->slots[b->slot[g]];
        const int64_t size = b->starts[g + 1] - b->starts[g], chunks = (size + b->chunk - 1) / b->chunk;
        for (int64_t q = 0; q < slot->count; q++) {
            const LoraProduct *p = &slot->products[q];
            *items += chunks * ((p->rank + RANK_BLOCK - 1) / RANK_BLOCK + (p->columns + COLUMNS - 1) / COLUMNS);
            *floats += size * padded_rank(p->rank);
            *work += size * p->rank * (layer->in_features + p->columns);
        }
    }
}

/* The bodies. Tile shapes: AVX-512's 32 registers hold 4 rows by 4 vectors of accumulators,
 * AVX2's and SSE's 16 fewer. Each shrink item's 32 ranks are 32 / WIDTH vectors, computed
 * SHRINK_VECTORS at a time. The body undefines these parameters at its end. */
#define LORA_BODY
#define NAME(name) name##_avx512
#define TARGET __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define WIDTH 16
#define SHRINK_TILE 4
#define SHRINK_VECTORS 2
#define EXPAND_TILE 4
#define EXPAND_VECTORS 4
#include __FILE__

#define NAME(name) name##_avx2
#define TARGET __attribute__((target("avx2,fma")))
#define WIDTH 8
#define SHRINK_TILE 2
#define SHRINK_VECTORS 4
#define EXPAND_TILE 2
#define EXPAND_VECTORS 4
#include __FILE__

/* Four floats: SSE2 (x86-64's baseline) and NEON both have them. */
#define NAME(name) name##_portable
#define TARGET
#define WIDTH 4
#define SHRINK_TILE 2
#define SHRINK_VECTORS 4
#define EXPAND_TILE 2
#define EXPAND_VECTORS 4
#include __FILE__

/* y [rows][out_features] += each batch row's adapter's products of x [rows][in_features]; x and
 * y float32, or bfloat16 where `bf16`. */
void srv_lora_add(const LoraLayer *layer, const void *x, void *y, int64_t bf16) {
    const LoraBatch *b = layer->batch;
    if (b->groups == 0) return;
    int64_t item_count, floats, work, shrinks = 0;
    sizes(layer, &item_count, &floats, &work);
    if (item_count == 0) return;
    Item *items = malloc((size_t)item_count * sizeof(Item));
    float *t = malloc((size_t)floats * sizeof(float));
    float *widened = bf16 ? malloc((size_t)(b->starts[b->groups] * layer->in_features) * sizeof(float)) : NULL;
    const int64_t expands = list_items(layer, t, items, &shrinks);
    const int parallel = work >= b->parallel_work;
    if (b->isa == 2) lora_add_avx512(layer, items, shrinks, expands, x, y, widened, bf16 != 0, parallel);
    else if (b->isa == 1) lora_add_avx2(layer, items, shrinks, expands, x, y, widened, bf16 != 0, parallel);
    else lora_add_portable(layer, items, shrinks, expands, x, y, widened, bf16 != 0, parallel);
    free(widened);
    free(t);
    free(items);
}

/* A linear kernel (srv.sdk.native): the base layer's product, then the batch's adapters'. */
void srv_lora_linear(const void *context, const float *x, int64_t rows, float *y) {
    const LoraLayer *layer = context;
    ((LinearFunction)layer->base.function)(layer->base.context, x, rows, y);
    srv_lora_add(layer, x, y, 0);
}

#else /* LORA_BODY: one instruction set's body, NAME, TARGET, WIDTH and the tile shapes defined */

/* WIDTH floats as one value (GCC's vector extension), loaded unaligned; bfloat16 weights and
 * rows widen WIDTH at a time. */
typedef float NAME(Vector) __attribute__((vector_size(WIDTH * sizeof(float))));
typedef float NAME(VectorUnaligned) __attribute__((vector_size(WIDTH * sizeof(float)), aligned(4), may_alias));
typedef uint16_t NAME(Halves) __attribute__((vector_size(WIDTH * sizeof(uint16_t))));
typedef uint16_t NAME(HalvesUnaligned) __attribute__((vector_size(WIDTH * sizeof(uint16_t)), aligned(2), may_alias));
typedef uint32_t NAME(Words) __attribute__((vector_size(WIDTH * sizeof(uint32_t))));
#define Vector NAME(Vector)
#define LOAD(p) ((Vector)(*(const NAME(VectorUnaligned) *)(p)))
#define STORE(p, v) (*(NAME(VectorUnaligned) *)(p) = (v))

TARGET static inline __attribute__((always_inline)) Vector NAME(widen_vector)(const uint16_t *p) {
    return (Vector)(__builtin_convertvector(*(const NAME(HalvesUnaligned) *)p, NAME(Words)) << 16);
}

TARGET static inline __attribute__((always_inline)) NAME(Halves) NAME(narrow_vector)(Vector v) {
    const NAME(Words) bits = (NAME(Words))v;
    const NAME(Words) rounded = (bits + 0x7fffu + ((bits >> 16) & 1)) >> 16;
    const NAME(Words) nan = (bits & 0x7fffffffu) > 0x7f800000u;   /* all ones where NaN */
    return __builtin_convertvector((rounded & ~nan) | (((bits >> 16) | 0x40) & nan), NAME(Halves));
}

/* Element i of float32 or bfloat16 values (`bf16` a constant where inlined). */
#define WEIGHTS(p, i, bf16) ((bf16) ? NAME(widen_vector)((const uint16_t *)(p) + (i)) : LOAD((const float *)(p) + (i)))

/* Rows [r0, r0 + n) of the item times `vectors` vectors of A^T's ranks from `a0`, in a tile of
 * `tile` rows (n at most tile; the rest of the tile repeats row r0). */
TARGET static inline __attribute__((always_inline)) void NAME(shrink_tile)(
        const LoraLayer *layer, const Item *item, const float *x, const float *widened, int64_t r0, int64_t n,
        int64_t a0, const int64_t tile, const int64_t vectors, const int weights_bf16) {
    const LoraBatch *b = layer->batch;
    const LoraProduct *p = product_of(layer, item);
    const int64_t in = layer->in_features, stride = padded_rank(p->rank);
    const int64_t *rows = b->rows + b->starts[item->group];
    const float *xr[MAX_TILE_ROWS];
    for (int64_t r = 0; r < tile; r++) {
        const int64_t row = r0 + (r < n ? r : 0);
        xr[r] = widened ? widened + (b->starts[item->group] + row) * in : x + rows[row] * in;
    }
    Vector acc[MAX_TILE_ROWS][SHRINK_VECTORS] = {{0}};
    for (int64_t i = 0; i < in; i++)
        for (int64_t v = 0; v < vectors; v++) {
            const Vector weights = WEIGHTS(p->at, i * stride + a0 + v * WIDTH, weights_bf16);
            for (int64_t r = 0; r < tile; r++) acc[r][v] += xr[r][i] * weights;
        }
    for (int64_t r = 0; r < n; r++)
        for (int64_t v = 0; v < vectors; v++) STORE(item->t + (r0 + r) * stride + a0 + v * WIDTH, acc[r][v]);
}

/* t = x A^T for the item's rows and block of ranks; the weights float32 or bfloat16 (a constant
 * where inlined). x is float32: the batch's rows as they are (`widened` NULL), or, for bfloat16
 * rows, `widened`, their float32 copies in the order of the batch's row list. */
TARGET static inline __attribute__((always_inline)) void NAME(shrink)(const LoraLayer *layer, const Item *item,
                                                                      const float *x, const float *widened,
                                                                      const int weights_bf16) {
    const int64_t stride = padded_rank(product_of(layer, item)->rank);
    const int64_t first = item->block * RANK_BLOCK, last = first + RANK_BLOCK < stride ? first + RANK_BLOCK : stride;
    const int64_t end = item->first + item->count, step = SHRINK_VECTORS * WIDTH;
    for (int64_t r0 = item->first; r0 < end; r0 += SHRINK_TILE) {
        const int64_t n = end - r0 < SHRINK_TILE ? end - r0 : SHRINK_TILE;
        int64_t a0 = first;
        for (; a0 + step <= last; a0 += step)
            NAME(shrink_tile)(layer, item, x, widened, r0, n, a0, SHRINK_TILE, SHRINK_VECTORS, weights_bf16);
        /* The rest: PAD ranks (a block is one or two PADs), PAD / WIDTH vectors. */
        if (a0 < last)
            NAME(shrink_tile)(layer, item, x, widened, r0, n, a0, SHRINK_TILE, PAD / WIDTH, weights_bf16);
    }
}

/* y's columns [j, j + width) of a row, width at most WIDTH, plus `delta`. */
TARGET static inline __attribute__((always_inline)) void NAME(add_to)(void *y, int64_t j, int64_t width, Vector delta,
                                                                      const int y_bf16) {
    if (width == WIDTH) {
        if (y_bf16) {
            NAME(HalvesUnaligned) *h = (NAME(HalvesUnaligned) *)((uint16_t *)y + j);
            *h = NAME(narrow_vector)(NAME(widen_vector)((const uint16_t *)y + j) + delta);
        } else {
            STORE((float *)y + j, LOAD((const float *)y + j) + delta);
        }
    } else {
        for (int64_t l = 0; l < width; l++) {
            if (y_bf16) ((uint16_t *)y)[j + l] = narrow(widen(((const uint16_t *)y)[j + l]) + delta[l]);
            else ((float *)y)[j + l] += delta[l];
        }
    }
}

/* y += scaling * t B^T for the item's rows and block of columns, in tiles of EXPAND_TILE rows by
 * EXPAND_VECTORS vectors; the weights and y float32 or bfloat16 (constants where inlined). */
TARGET static inline __attribute__((always_inline)) void NAME(expand)(const LoraLayer *layer, const Item *item, void *y,
                                                                      const int weights_bf16, const int y_bf16) {
    const LoraBatch *b = layer->batch;
    const LoraProduct *p = product_of(layer, item);
    const int64_t out = layer->out_features, rank = p->rank, stride = padded_rank(rank);
    const int64_t *rows = b->rows + b->starts[item->group];
    const int64_t j0 = item->block * COLUMNS;
    const int64_t width = p->columns - j0 < COLUMNS ? p->columns - j0 : COLUMNS;
    const int64_t block = item->block * rank * COLUMNS; /* the block's first weight */
    const int64_t end = item->first + item->count;
    for (int64_t r0 = item->first; r0 < end; r0 += EXPAND_TILE) {
        const int64_t n = end - r0 < EXPAND_TILE ? end - r0 : EXPAND_TILE;
        const float *tr[MAX_TILE_ROWS];
        for (int64_t r = 0; r < EXPAND_TILE; r++) tr[r] = item->t + (r0 + (r < n ? r : 0)) * stride;
        for (int64_t c = 0; c < COLUMNS / WIDTH && c * WIDTH < width; c += EXPAND_VECTORS) {
            Vector acc[MAX_TILE_ROWS][EXPAND_VECTORS] = {{0}};
            for (int64_t k = 0; k < rank; k++)
                for (int64_t v = 0; v < EXPAND_VECTORS; v++) {
                    const Vector weights = WEIGHTS(p->bt, block + k * COLUMNS + (c + v) * WIDTH, weights_bf16);
                    for (int64_t r = 0; r < EXPAND_TILE; r++) acc[r][v] += tr[r][k] * weights;
                }
            for (int64_t r = 0; r < n; r++) {
                const int64_t first = rows[r0 + r] * out + p->offset + j0; /* the row's first column here */
                for (int64_t v = 0; v < EXPAND_VECTORS; v++) {
                    const int64_t j = (c + v) * WIDTH;
                    if (j < width)
                        NAME(add_to)(y, first + j, width - j < WIDTH ? width - j : WIDTH, p->scaling * acc[r][v],
                                     y_bf16);
                }
            }
        }
    }
}

/* Every item of the batch: bfloat16 rows are widened first, once each (every target and rank
 * block of the layer reads them), then the shrink pass, then the expand pass. */
TARGET static void NAME(lora_add)(const LoraLayer *layer, const Item *items, int64_t shrinks, int64_t expands,
                                  const void *rows, void *y, float *widened, int bf16, int parallel) {
    const LoraBatch *b = layer->batch;
    const int64_t in = layer->in_features, listed = b->starts[b->groups], body = in - in % WIDTH;
    const float *x = rows;
#pragma omp parallel if (parallel)
    {
        if (widened) {
#pragma omp for
            for (int64_t r = 0; r < listed; r++) {
                const uint16_t *from = (const uint16_t *)rows + b->rows[r] * in;
                float *to = widened + r * in;
                for (int64_t i = 0; i < body; i += WIDTH) STORE(to + i, NAME(widen_vector)(from + i));
                for (int64_t i = body; i < in; i++) to[i] = widen(from[i]);
            }
        }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < shrinks; i++) {
            const Item *item = &items[i];
            if (product_of(layer, item)->bf16) NAME(shrink)(layer, item, x, widened, 1);
            else NAME(shrink)(layer, item, x, widened, 0);
        }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < expands; i++) {
            const Item *item = &items[shrinks + i];
            const int weights_bf16 = product_of(layer, item)->bf16 != 0;
            if (weights_bf16 && bf16) NAME(expand)(layer, item, y, 1, 1);
            else if (weights_bf16) NAME(expand)(layer, item, y, 1, 0);
            else if (bf16) NAME(expand)(layer, item, y, 0, 1);
            else NAME(expand)(layer, item, y, 0, 0);
        }
    }
}

#undef Vector
#undef LOAD
#undef STORE
#undef WEIGHTS
#undef NAME
#undef TARGET
#undef WIDTH
#undef SHRINK_TILE
#undef SHRINK_VECTORS
#undef EXPAND_TILE
#undef EXPAND_VECTORS

#endif /* LORA_BODY */
