/* The mocker's block pool state and operations in C (tandem.engines.mocker.block_pool: the
 * semantics, and the Python pool this must equal step for step). Per block: a reference
 * count, the cached hash (with a flag: any u64 is a hash), the parent hash, a LoRA index
 * (-1: none) and the insertion stamp of its hash (the Python pool's dict order, for
 * snapshots). Free blocks sit in a FIFO ring; cached unreferenced blocks in an intrusive
 * doubly linked LRU list (oldest at the head); hashes map to block ids in an open-addressing
 * table (linear probing, backward-shift deletion). Every operation takes whole arrays. */
#include <stdint.h>
#include <stdlib.h>

/* counts[]: the free ring's length, the LRU's length, cached blocks, active blocks (first in
 * the struct: Python reads them in place) */
enum { FREE, LRU, CACHED, ACTIVE };

typedef struct {
    int64_t counts[4];
    int64_t n;
    int64_t *ref;
    uint64_t *hash;
    uint64_t *parent;
    uint64_t *stamp;  /* insertion order of the hash, 0: uncached */
    int32_t *lora;
    uint8_t *has_hash, *has_parent, *in_lru;
    int64_t *ring; /* free FIFO: ring[(head + i) % n] */
    int64_t ring_head;
    int64_t *prev, *next; /* LRU links, -1 at the ends */
    int64_t lru_head, lru_tail;
    uint64_t *keys;  /* hash table */
    int64_t *vals;   /* block id, -1: empty slot */
    uint64_t mask;
    uint64_t next_stamp;
} th_pool;

static uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

void th_pool_free(th_pool *p) {
    if (!p) return;
    free(p->ref); free(p->hash); free(p->parent); free(p->stamp); free(p->lora);
    free(p->has_hash); free(p->has_parent); free(p->in_lru); free(p->ring);
    free(p->prev); free(p->next); free(p->keys); free(p->vals);
    free(p);
}

th_pool *th_pool_new(int64_t n) {
    th_pool *p = calloc(1, sizeof *p);
    if (!p || n <= 0) { free(p); return NULL; }
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap <<= 1;
    p->n = n;
    p->ref = calloc(n, sizeof *p->ref);
    p->hash = calloc(n, sizeof *p->hash);
    p->parent = calloc(n, sizeof *p->parent);
    p->stamp = calloc(n, sizeof *p->stamp);
    p->lora = calloc(n, sizeof *p->lora);
    p->has_hash = calloc(n, 1);
    p->has_parent = calloc(n, 1);
    p->in_lru = calloc(n, 1);
    p->ring = calloc(n, sizeof *p->ring);
    p->prev = calloc(n, sizeof *p->prev);
    p->next = calloc(n, sizeof *p->next);
    p->keys = calloc(cap, sizeof *p->keys);
    p->vals = malloc(cap * sizeof *p->vals);
    if (!p->ref || !p->hash || !p->parent || !p->stamp || !p->lora || !p->has_hash ||
        !p->has_parent || !p->in_lru || !p->ring || !p->prev || !p->next || !p->keys ||
        !p->vals) {
        th_pool_free(p);
        return NULL;
    }
    for (uint64_t i = 0; i < cap; i++) p->vals[i] = -1;
    p->mask = cap - 1;
    for (int64_t i = 0; i < n; i++) {
        p->ring[i] = i;
        p->lora[i] = -1;
        p->prev[i] = p->next[i] = -1;
    }
    p->counts[FREE] = n;
    p->lru_head = p->lru_tail = -1;
    p->next_stamp = 1;
    return p;
}

/* ------------------------------------------------------------------ hash table */
static int64_t map_get(const th_pool *p, uint64_t key) {
    for (uint64_t i = mix(key) & p->mask;; i = (i + 1) & p->mask) {
        if (p->vals[i] < 0) return -1;
        if (p->keys[i] == key) return p->vals[i];
    }
}

static void map_put(th_pool *p, uint64_t key, int64_t block_id) { /* key is absent */
    uint64_t i = mix(key) & p->mask;
    while (p->vals[i] >= 0) i = (i + 1) & p->mask;
    p->keys[i] = key;
    p->vals[i] = block_id;
    p->counts[CACHED]++;
}

static void map_del(th_pool *p, uint64_t key) { /* key is present */
    uint64_t i = mix(key) & p->mask;
    while (p->keys[i] != key || p->vals[i] < 0) i = (i + 1) & p->mask;
    /* backward shift: move later entries of the probe run into the hole */
    for (uint64_t j = (i + 1) & p->mask; p->vals[j] >= 0; j = (j + 1) & p->mask) {
        const uint64_t home = mix(p->keys[j]) & p->mask;
        /* j's entry may fill hole i unless its home lies cyclically in (i, j] */
        if (((j - home) & p->mask) >= ((j - i) & p->mask)) {
            p->keys[i] = p->keys[j];
            p->vals[i] = p->vals[j];
            i = j;
        }
    }
    p->vals[i] = -1;
    p->counts[CACHED]--;
}

/* ------------------------------------------------------------------ lists */
static void lru_push(th_pool *p, int64_t b) {
    p->prev[b] = p->lru_tail;
    p->next[b] = -1;
    if (p->lru_tail >= 0) p->next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    p->in_lru[b] = 1;
    p->counts[LRU]++;
}

static void lru_unlink(th_pool *p, int64_t b) {
    if (p->prev[b] >= 0) p->next[p->prev[b]] = p->next[b]; else p->lru_head = p->next[b];
    if (p->next[b] >= 0) p->prev[p->next[b]] = p->prev[b]; else p->lru_tail = p->prev[b];
    p->prev[b] = p->next[b] = -1;
    p->in_lru[b] = 0;
    p->counts[LRU]--;
}

/* ------------------------------------------------------------------ queries */
int64_t th_pool_ref_count(const th_pool *p, int64_t b) { return p->ref[b]; }

/* Block ids of the longest cached prefix of hashes; returns its length. */
int64_t th_pool_match(const th_pool *p, const uint64_t *hashes, int64_t num, int64_t *out) {
    int64_t k = 0;
    for (; k < num; k++) {
        const int64_t b = map_get(p, hashes[k]);
        if (b < 0) break;
        out[k] = b;
    }
    return k;
}

/* ------------------------------------------------------------------ mutations */
/* The mutations below return -2 (nothing changes) if an id is out of range. */
static int out_of_range(const th_pool *p, const int64_t *ids, int64_t num) {
    int64_t bad = 0;
    for (int64_t i = 0; i < num; i++) bad |= (uint64_t)ids[i] >= (uint64_t)p->n;
    return bad != 0;
}

/* Returns -1, or the index of a free block met (after the ones before it took effect). */
int64_t th_pool_acquire(th_pool *p, const int64_t *ids, int64_t num) {
    if (out_of_range(p, ids, num)) return -2;
    for (int64_t i = 0; i < num; i++) {
        const int64_t b = ids[i];
        if (p->ref[b] == 0) {
            if (!p->has_hash[b]) return i;
            lru_unlink(p, b);
            p->counts[ACTIVE]++;
        }
        p->ref[b]++;
    }
    return -1;
}

/* num fresh blocks into out (free ones first, then the LRU's oldest); the hashes of evicted
 * blocks into removed with, per evicted block, its parent, parent flag and LoRA index.
 * Returns the number evicted, or -1 (nothing changes) if fewer than num are available. */
int64_t th_pool_allocate(th_pool *p, int64_t num, int64_t *out, uint64_t *removed,
                         uint64_t *parents, uint8_t *has_parents, int32_t *loras) {
    if (num > p->counts[FREE] + p->counts[LRU]) return -1;
    if (num < 0) { p->counts[ACTIVE] += num; return 0; }
    const int64_t take = num < p->counts[FREE] ? num : p->counts[FREE];
    for (int64_t i = 0; i < take; i++) {
        const int64_t b = p->ring[p->ring_head];
        p->ring_head = (p->ring_head + 1) % p->n;
        out[i] = b;
        p->ref[b] = 1;
    }
    p->counts[FREE] -= take;
    const int64_t evict = num - take;
    for (int64_t k = 0; k < evict; k++) {
        const int64_t b = p->lru_head;
        lru_unlink(p, b);
        out[take + k] = b;
        removed[k] = p->hash[b];
        parents[k] = p->parent[b];
        has_parents[k] = p->has_parent[b];
        loras[k] = p->lora[b];
        map_del(p, p->hash[b]);
        p->has_hash[b] = 0;
        p->stamp[b] = 0;
        p->ref[b] = 1;
    }
    p->counts[ACTIVE] += num;
    return evict;
}

/* Cache computed full blocks ids[i] under hashes[i], chained from parent (has_parent), with
 * LoRA index lora. dup[i] = 1 where the hash was already cached (the block stays uncached),
 * counted in *num_dups. Returns -1, or the index of a bad block (unreferenced or hashed;
 * earlier ones took effect). */
int64_t th_pool_cache(th_pool *p, const int64_t *ids, const uint64_t *hashes, int64_t num,
                      int has_parent, uint64_t parent, int32_t lora, uint8_t *dup,
                      int64_t *num_dups) {
    if (out_of_range(p, ids, num)) return -2;
    *num_dups = 0;
    uint64_t prev = parent;
    int have = has_parent;
    for (int64_t i = 0; i < num; i++) {
        const int64_t b = ids[i];
        const uint64_t h = hashes[i];
        if (p->ref[b] <= 0 || p->has_hash[b]) return i;
        if (map_get(p, h) >= 0) {
            dup[i] = 1;
            ++*num_dups;
        } else {
            dup[i] = 0;
            p->has_hash[b] = 1;
            p->hash[b] = h;
            p->has_parent[b] = (uint8_t)have;
            p->parent[b] = have ? prev : 0;
            p->lora[b] = lora;
            p->stamp[b] = p->next_stamp++;
            map_put(p, h, b);
        }
        prev = h;
        have = 1;
    }
    return -1;
}

/* Drop one reference from each block, last first. Returns -1, or the index of a block
 * with no reference (the later ones took effect; the active count is left as it was). */
int64_t th_pool_release(th_pool *p, const int64_t *ids, int64_t num) {
    if (out_of_range(p, ids, num)) return -2;
    int64_t unused = 0;
    for (int64_t i = num - 1; i >= 0; i--) {
        const int64_t b = ids[i];
        if (p->ref[b] <= 0) return i;
        if (--p->ref[b] == 0) {
            unused++;
            if (p->has_hash[b]) {
                lru_push(p, b);
            } else {
                p->ring[(p->ring_head + p->counts[FREE]) % p->n] = b;
                p->counts[FREE]++;
            }
        }
    }
    p->counts[ACTIVE] -= unused;
    return -1;
}

/* ------------------------------------------------------------------ snapshot / checks */
/* Every cached block: its id, hash, parent (flag) and LoRA index, in any order, with its
 * stamp (the caller orders by it). Returns the number written (num_cached). */
int64_t th_pool_cached(const th_pool *p, int64_t *ids, uint64_t *hashes, uint64_t *parents,
                       uint8_t *has_parents, int32_t *loras, uint64_t *stamps) {
    int64_t k = 0;
    for (int64_t b = 0; b < p->n; b++) {
        if (!p->has_hash[b]) continue;
        ids[k] = b;
        hashes[k] = p->hash[b];
        parents[k] = p->parent[b];
        has_parents[k] = p->has_parent[b];
        loras[k] = p->lora[b];
        stamps[k] = p->stamp[b];
        k++;
    }
    return k;
}

/* 0 if consistent, else a code (block id in *where): 1 free twice, 2 free and evictable,
 * 3 negative ref, 4 in use and listed, 5 leaked free, 6 leaked cached, 7 hash not indexed,
 * 8 active count, 9 index names uncached blocks, 10 LRU links broken. */
int64_t th_pool_check(const th_pool *p, int64_t *where) {
    uint8_t *seen = calloc(p->n, 1);
    int64_t code = 0;
    *where = -1;
    if (!seen) return -2;
    for (int64_t i = 0; i < p->counts[FREE] && !code; i++) {
        const int64_t b = p->ring[(p->ring_head + i) % p->n];
        if (seen[b]) code = 1, *where = b;
        seen[b] = 1;
    }
    int64_t count = 0, last = -1;
    for (int64_t b = p->lru_head; b >= 0 && !code; last = b, b = p->next[b]) {
        if (++count > p->n || p->prev[b] != last || !p->in_lru[b]) code = 10, *where = b;
        else if (seen[b] & 1) code = 2, *where = b;
        else seen[b] |= 2;
    }
    if (!code && (count != p->counts[LRU] || last != p->lru_tail)) code = 10;
    int64_t active = 0, hashed = 0;
    for (int64_t b = 0; b < p->n && !code; b++) {
        if (p->in_lru[b] && !(seen[b] & 2)) code = 10, *where = b;
        else if (p->ref[b] < 0) code = 3, *where = b;
        else if (p->ref[b] > 0) {
            active++;
            if (seen[b]) code = 4, *where = b;
        } else if (!p->has_hash[b] && !(seen[b] & 1)) code = 5, *where = b;
        else if (p->has_hash[b] && !(seen[b] & 2)) code = 6, *where = b;
        if (!code && p->has_hash[b]) {
            hashed++;
            if (map_get(p, p->hash[b]) != b) code = 7, *where = b;
        }
    }
    if (!code && active != p->counts[ACTIVE]) code = 8, *where = active;
    int64_t entries = 0;
    for (uint64_t i = 0; i <= p->mask && !code; i++) {
        const int64_t b = p->vals[i];
        if (b < 0) continue;
        entries++;
        if (b >= p->n || !p->has_hash[b] || p->hash[b] != p->keys[i]) code = 9, *where = b;
    }
    if (!code && (entries != hashed || hashed != p->counts[CACHED])) code = 9;
    free(seen);
    return code;
}
