/* A completions body's `prompt` token ids, straight from the JSON bytes into u32s
 * (frontend/prompt_ids.py). Only the plainest shape is taken: the top-level object's one
 * "prompt" key (spelled without escapes) whose value is a flat array of JSON integers written
 * as digits (no sign, fraction or exponent), each < 2^32, or an array of such arrays. Anything else answers 0 / -1 and the
 * caller decodes the body the general way, which says what is wrong with it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The flat array at s[j] ('['): one past its ']' in *close and its number of elements (commas
 * + 1) in *count; 0 without a ']'. What lies between is checked by ji_parse_u32 (a nested
 * array fails there): here one `memchr` and one branch-free count of the commas. */
static int flat_array(const unsigned char *s, int64_t n, int64_t j, int64_t *close,
                      int64_t *count) {
    const unsigned char *at = memchr(s + j, ']', (size_t)(n - j));
    if (at == NULL) return 0;
    int64_t k = at - s, commas = 0;
    for (int64_t q = j + 1; q < k; q++) commas += s[q] == ',';
    *close = k + 1;
    *count = commas + 1;
    return 1;
}

/* The array of flat arrays at s[j]: one past its ']' in *close and the number of inner arrays
 * in *count; with `spans`, each inner array's start, end and element count (3 per array, at
 * most `cap` arrays). 0 when it is not that shape. */
static int batch_array(const unsigned char *s, int64_t n, int64_t j, int64_t *close,
                       int64_t *count, int64_t *spans, int64_t cap) {
    int64_t k = j + 1, num = 0;
    for (;;) {
        while (k < n && is_ws(s[k])) k++;
        if (k >= n || s[k] != '[') return 0;
        int64_t inner_end, inner_count;
        if (!flat_array(s, n, k, &inner_end, &inner_count)) return 0;
        if (spans != NULL) {
            if (num >= cap) return 0;
            spans[3 * num] = k;
            spans[3 * num + 1] = inner_end;
            spans[3 * num + 2] = inner_count;
        }
        num++;
        for (k = inner_end; k < n && is_ws(s[k]); k++) {}
        if (k >= n) return 0;
        if (s[k] == ']') break;
        if (s[k] != ',') return 0;
        k++;
    }
    *close = k + 1;
    *count = num;
    return 1;
}

/* Finds the "prompt" value: 1 for a flat array ([*start, *end) from '[' to one past ']', *count
 * its elements), 2 for an array of flat arrays (*count the arrays: `ji_batch_spans` lists
 * them); 0 when the body has not that shape (not an object, no such key, the key twice or any
 * top-level key with an escape, another value). Strings are skipped by their unescaped quotes
 * and nesting counted outside them, as any JSON reader sees them; a body that is not JSON is
 * left to the caller's decoder. */
int ji_find_prompt(const unsigned char *s, int64_t n, int64_t *start, int64_t *end,
                   int64_t *count) {
    int64_t i = 0, depth = 0;
    int found = 0;
    while (i < n && is_ws(s[i])) i++;
    if (i >= n || s[i] != '{') return 0;
    for (; i < n; i++) {
        unsigned char c = s[i];
        if (c == '"') {
            int64_t k0 = i + 1, escaped = 0;
            for (i++; i < n && s[i] != '"'; i++) {
                if (s[i] == '\\') { escaped = 1; i++; }
            }
            if (i >= n) return 0;
            if (depth != 1) continue;
            int64_t k1 = i, j = i + 1;
            while (j < n && is_ws(s[j])) j++;
            if (j >= n || s[j] != ':') continue; /* a value, not a key */
            if (escaped) return 0;               /* a key we cannot compare as bytes */
            if (k1 - k0 != 6 || s[k0] != 'p' || s[k0 + 1] != 'r' || s[k0 + 2] != 'o' ||
                s[k0 + 3] != 'm' || s[k0 + 4] != 'p' || s[k0 + 5] != 't')
                continue;
            if (found) return 0; /* twice: leave which one wins to the decoder */
            for (j++; j < n && is_ws(s[j]); j++) {}
            if (j >= n || s[j] != '[') return 0;
            int64_t k = j + 1;
            while (k < n && is_ws(s[k])) k++;
            found = k < n && s[k] == '[' ? 2 : 1;
            if (found == 2 ? !batch_array(s, n, j, end, count, NULL, 0)
                           : !flat_array(s, n, j, end, count))
                return 0;
            *start = j;
            i = *end - 1; /* the closing ']' */
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return found;
}

/* The inner arrays of the batch body[start..end) found above: 3 int64 per array into spans
 * (start, end, element count); returns how many (== cap), or -1. */
int64_t ji_batch_spans(const unsigned char *body, int64_t start, int64_t end, int64_t *spans,
                       int64_t cap) {
    int64_t close, count;
    if (!batch_array(body, end, start, &close, &count, spans, cap)) return -1;
    return close == end && count == cap ? count : -1;
}

/* Parse the flat array body[start..end) ('[' ... ']', as found above) into out[0..cap): strict JSON
 * integers (0 or a digit 1-9 then digits), each < 2^32, separated by commas. Returns the
 * number parsed (== cap) with *max the largest, or -1 when an element breaks that grammar. */
int64_t ji_parse_u32(const unsigned char *body, int64_t start, int64_t end, uint32_t *out,
                     int64_t cap, uint32_t *max) {
    const unsigned char *s = body + start;
    int64_t n = end - start, i = 1, m = 0;
    uint32_t top = 0;
    if (n < 2 || s[0] != '[' || s[n - 1] != ']') return -1;
    n--; /* the ']' */
    for (;;) {
        while (i < n && is_ws(s[i])) i++;
        if (i >= n || s[i] < '0' || s[i] > '9') return -1;
        uint64_t v = (uint64_t)(s[i] - '0');
        int64_t d0 = i++;
        if (v == 0 && i < n && s[i] >= '0' && s[i] <= '9') return -1; /* leading zero */
        while (i < n && s[i] >= '0' && s[i] <= '9') v = v * 10 + (uint64_t)(s[i++] - '0');
        if (i - d0 > 10 || v > 0xFFFFFFFFull) return -1; /* > 10 digits may have wrapped */
        if (m >= cap) return -1;
        out[m++] = (uint32_t)v;
        if ((uint32_t)v > top) top = (uint32_t)v;
        while (i < n && is_ws(s[i])) i++;
        if (i >= n) break;
        if (s[i] != ',') return -1;
        i++;
    }
    if (m != cap) return -1;
    *max = top;
    return m;
}
