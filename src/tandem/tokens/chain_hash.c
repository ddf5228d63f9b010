/* Block hashes of a prompt in one C pass (tandem.tokens.hashing: the scheme and the Python
 * twin this must equal). The XXH3-64 function is the one the `xxhash` package already
 * loaded (its extension exports XXH3_64bits_withSeed), handed over as a pointer, so the C
 * pass and the Python pass hash with the same code. Little-endian hosts only (the token
 * ids are hashed as their in-memory u32s and each chain pair as two in-memory u64s). */
#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*th_xxh3)(const void *data, size_t len, uint64_t seed);

/* out[b] for each of num_blocks full blocks of block_size ids: the block's local hash
 * (XXH3-64 of its ids, seed0 for block 0 and seed after), or with chain its sequence hash:
 * local for the first block of a chain, else XXH3-64(seed) of (previous, local); with
 * has_parent the chain continues from parent. Returns num_blocks. */
int64_t th_block_hashes(th_xxh3 xxh3, const uint32_t *ids, int64_t num_blocks,
                        int64_t block_size, uint64_t seed0, uint64_t seed, int chain,
                        int has_parent, uint64_t parent, uint64_t *out) {
    uint64_t prev = parent;
    int have = has_parent;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint64_t local = xxh3(ids + b * block_size, (size_t)block_size * 4, b ? seed : seed0);
        if (!chain) {
            out[b] = local;
            continue;
        }
        if (have) {
            const uint64_t pair[2] = {prev, local};
            prev = xxh3(pair, sizeof pair, seed);
        } else {
            prev = local;
            have = 1;
        }
        out[b] = prev;
    }
    return num_blocks;
}
