/* Crop-decode kernel of the batch loader (shardkit.readers): JPEG bytes (or a raw record's pixels) +
 * a crop box in, the crop resized to the output size (and maybe flipped) out, written straight into
 * the batch buffer.
 *
 * Only what the box needs is decoded: libjpeg-turbo's DCT scaling (1/2, 1/4, 1/8) when the box is
 * at least twice the output, jpeg_crop_scanline for the columns and jpeg_skip_scanlines for the
 * rows above, and nothing below it. The resample is Pillow's antialiased bilinear filter (Pillow's
 * coefficients, from Resample.c) over the box in the decoded image, which is what torchvision's
 * RandomResizedCrop computes on a PIL image. On x86-64 the pixels are decoded as RGBX and filtered
 * with int16 weights two taps per pmaddwd (as Pillow-SIMD does); elsewhere with Pillow's own 22-bit
 * fixed point over RGB.
 *
 * A whole batch is one call with the GIL released; the loader runs batches on several threads.
 * Every failure is per image (status and message); records the kernel does not handle (CMYK JPEGs)
 * are handed back as "unsupported" and take the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jerror.h>
#include <jpeglib.h>

#define PRECISION_BITS (32 - 8 - 2)
enum { OK = 0, FAILED = 1, UNSUPPORTED = 2 };

typedef struct {
    const unsigned char *data;
    size_t size;
    int raw_w, raw_h; /* a raw record's size (its pixels start at data); 0 for a JPEG */
    double box[4];    /* left, top, width, height in source pixels */
    int flip;
    unsigned char *out; /* height rows of width * 3 bytes */
    int status;
    char message[JMSG_LENGTH_MAX];
} Job;

/* Grow-only scratch memory of one call: decoded rows, the horizontal pass, filter weights. */
typedef struct {
    unsigned char *region, *temp;
    double *weights;
    int32_t *xk, *yk, *row;
    int *xb, *yb;
    size_t region_size, temp_size, weights_size, xk_size, yk_size, row_size, xb_size, yb_size;
} Scratch;

static int grow(void **buffer, size_t *have, size_t need) {
    if (need <= *have) return 1;
    void *bigger = realloc(*buffer, need);
    if (bigger == NULL) return 0;
    *buffer = bigger;
    *have = need;
    return 1;
}

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    Job *job;
} Errors;

static void on_error(j_common_ptr cinfo) {
    Errors *errors = (Errors *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, errors->job->message);
    longjmp(errors->jump, 1);
}

/* libjpeg only warns on corrupt data and carries on with grey blocks: like shardkit's other
 * decoders, a warning fails the image. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo);
}

static double bilinear(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Pillow's precompute_coeffs (bilinear, support 1): for each output pixel the first input pixel
 * (bounds[2i]), the tap count (bounds[2i+1]) and `ksize` normalized weights (zero past the taps).
 * Returns ksize, or -1 when out of memory. */
static int coefficients(int in_size, double in0, double in1, int out_size, int **bounds, size_t *bounds_have,
                        Scratch *s) {
    double scale = (in1 - in0) / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    if (!grow((void **)bounds, bounds_have, sizeof(int) * 2 * (size_t)out_size) ||
        !grow((void **)&s->weights, &s->weights_size, sizeof(double) * (size_t)out_size * (size_t)ksize))
        return -1;
    for (int xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale, total = 0.0, ss = 1.0 / filterscale;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        double *w = s->weights + (size_t)xx * ksize;
        int x = 0;
        for (; x < xmax; x++) total += w[x] = bilinear((x + xmin - center + 0.5) * ss);
        for (x = 0; x < xmax; x++) w[x] = total != 0.0 ? w[x] / total : 0.0;
        for (; x < ksize; x++) w[x] = 0.0;
        (*bounds)[2 * xx] = xmin;
        (*bounds)[2 * xx + 1] = xmax;
    }
    return ksize;
}

static inline unsigned char clip8(int32_t v, int bits) {
    v >>= bits;
    return (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* A raw record's window row as RGBX for the paired passes (SSE2 builds only use it; the SSSE3
 * version below takes four pixels a shuffle where the CPU has it). */
static void rgb_to_rgbx_plain(const unsigned char *src, unsigned char *dst, int n) {
    for (size_t i = 0, count = (size_t)n; i < count; i++) {
        memcpy(dst + 4 * i, src + 3 * i, 3);
        dst[4 * i + 3] = 0xFF;
    }
}
static void (*rgb_to_rgbx)(const unsigned char *, unsigned char *, int) = rgb_to_rgbx_plain;

#if defined(__SSE2__)
#include <immintrin.h>
#define PAIR_BITS 14 /* int16 weights: two taps per pmaddwd */

/* The weights as int16 pairs packed for pmaddwd ((w[2j+1] << 16) | w[2j]), rounded so that every
 * output pixel's weights add up to exactly 1 << PAIR_BITS (a flat image stays flat). */
static int pack_pairs(const double *weights, int count, int ksize, int32_t **kk, size_t *have) {
    int pairs = (ksize + 1) / 2;
    if (!grow((void **)kk, have, sizeof(int32_t) * (size_t)count * (size_t)pairs)) return -1;
    int16_t *w = malloc(sizeof(int16_t) * (size_t)pairs * 2);
    if (w == NULL) return -1;
    for (int i = 0; i < count; i++) {
        const double *d = weights + (size_t)i * ksize;
        int total = 0, largest = 0;
        for (int k = 0; k < pairs * 2; k++) {
            w[k] = (int16_t)(k < ksize ? lround(d[k] * (1 << PAIR_BITS)) : 0);
            total += w[k];
            if (w[k] > w[largest]) largest = k;
        }
        w[largest] = (int16_t)(w[largest] + (1 << PAIR_BITS) - total);
        for (int j = 0; j < pairs; j++)
            (*kk)[(size_t)i * pairs + j] = (int32_t)(((uint32_t)(uint16_t)w[2 * j + 1] << 16) | (uint16_t)w[2 * j]);
    }
    free(w);
    return pairs;
}

/* Horizontal pass over RGBX rows into RGBX `temp`: one output pixel's four channels per register,
 * two taps per pmaddwd (the rows have 8 bytes of slack: the odd last tap reads a weightless pixel). */
static void horizontal_pairs(const unsigned char *region, size_t stride, int rows, int shift, const int *bounds,
                             const int32_t *kk, int pairs, int out_w, int flip, unsigned char *temp) {
    const __m128i zero = _mm_setzero_si128(), half = _mm_set1_epi32(1 << (PAIR_BITS - 1));
    for (int y = 0; y < rows; y++) {
        const unsigned char *src = region + stride * (size_t)y;
        unsigned char *dst = temp + (size_t)out_w * 4 * (size_t)y;
        for (int xx = 0; xx < out_w; xx++) {
            const unsigned char *p = src + (size_t)(bounds[2 * xx] - shift) * 4;
            const int32_t *w = kk + (size_t)xx * pairs;
            int steps = (bounds[2 * xx + 1] + 1) / 2;
            __m128i acc = half;
            for (int j = 0; j < steps; j++) {
                __m128i two = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p + 8 * j)), zero);
                __m128i paired = _mm_unpacklo_epi16(two, _mm_srli_si128(two, 8)); /* r0 r1 g0 g1 b0 b1 x0 x1 */
                acc = _mm_add_epi32(acc, _mm_madd_epi16(paired, _mm_set1_epi32(w[j])));
            }
            acc = _mm_srai_epi32(acc, PAIR_BITS);
            acc = _mm_packus_epi16(_mm_packs_epi32(acc, acc), zero);
            int32_t pixel = _mm_cvtsi128_si32(acc);
            memcpy(dst + (size_t)(flip ? out_w - 1 - xx : xx) * 4, &pixel, 4);
        }
    }
}

__attribute__((target("ssse3"))) static void rgbx_to_rgb_ssse3(const unsigned char *src, unsigned char *dst, int n) {
    const __m128i drop = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128i packed = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + 4 * i)), drop);
        _mm_storel_epi64((__m128i *)(dst + 3 * i), packed);
        int32_t last = _mm_cvtsi128_si32(_mm_srli_si128(packed, 8));
        memcpy(dst + 3 * i + 8, &last, 4);
    }
    for (; i < n; i++) memcpy(dst + 3 * i, src + 4 * i, 3);
}

static void rgbx_to_rgb_plain(const unsigned char *src, unsigned char *dst, int n) {
    for (int i = 0; i < n; i++) memcpy(dst + 3 * i, src + 4 * i, 3);
}

static void (*rgbx_to_rgb)(const unsigned char *, unsigned char *, int) = rgbx_to_rgb_plain;

/* A raw record's window row as RGBX for the paired passes: four pixels a shuffle (a byte-at-a-time
 * copy is a large share of a raw crop's time). The loads take 16 bytes for 12, so the last pixels of
 * the row, where 4 more bytes may lie past the record, go one by one. */
__attribute__((target("ssse3"))) static void rgb_to_rgbx_ssse3(const unsigned char *src, unsigned char *dst, int n) {
    const __m128i spread = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m128i opaque = _mm_set1_epi32((int)0xFF000000u);
    size_t i = 0, count = (size_t)n; /* offsets in size_t: 4 x a width over 2^29 overflows an int */
    for (; i + 6 <= count; i += 4) {
        __m128i pixels = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + 3 * i)), spread);
        _mm_storeu_si128((__m128i *)(dst + 4 * i), _mm_or_si128(pixels, opaque));
    }
    for (; i < count; i++) {
        memcpy(dst + 4 * i, src + 3 * i, 3);
        dst[4 * i + 3] = 0xFF;
    }
}

/* Columns [x, line) of one output row: 16 bytes at a time, then byte by byte. */
static void vertical_tail(const unsigned char *base, size_t line, size_t x, const int32_t *w, int taps,
                          unsigned char *row) {
    const __m128i zero = _mm_setzero_si128(), half = _mm_set1_epi32(1 << (PAIR_BITS - 1));
    int steps = (taps + 1) / 2;
    for (; x + 16 <= line; x += 16) {
        __m128i a0 = half, a1 = half, a2 = half, a3 = half;
        for (int j = 0; j < steps; j++) {
            const unsigned char *r0 = base + line * (size_t)(2 * j) + x;
            const unsigned char *r1 = 2 * j + 1 < taps ? r0 + line : r0; /* weightless when odd */
            __m128i s0 = _mm_loadu_si128((const __m128i *)r0), s1 = _mm_loadu_si128((const __m128i *)r1);
            __m128i lo = _mm_unpacklo_epi8(s0, s1), hi = _mm_unpackhi_epi8(s0, s1), weight = _mm_set1_epi32(w[j]);
            a0 = _mm_add_epi32(a0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), weight));
            a1 = _mm_add_epi32(a1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), weight));
            a2 = _mm_add_epi32(a2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), weight));
            a3 = _mm_add_epi32(a3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), weight));
        }
        __m128i low = _mm_packs_epi32(_mm_srai_epi32(a0, PAIR_BITS), _mm_srai_epi32(a1, PAIR_BITS));
        __m128i high = _mm_packs_epi32(_mm_srai_epi32(a2, PAIR_BITS), _mm_srai_epi32(a3, PAIR_BITS));
        _mm_storeu_si128((__m128i *)(row + x), _mm_packus_epi16(low, high));
    }
    for (; x < line; x++) { /* the last pixels when out_w is not a multiple of four */
        int32_t acc = 1 << (PAIR_BITS - 1);
        for (int j = 0; j < steps; j++) {
            int16_t w0 = (int16_t)(w[j] & 0xFFFF), w1 = (int16_t)((uint32_t)w[j] >> 16);
            acc += base[line * (size_t)(2 * j) + x] * w0;
            if (2 * j + 1 < taps) acc += base[line * (size_t)(2 * j + 1) + x] * w1;
        }
        row[x] = clip8(acc, PAIR_BITS);
    }
}

/* Vertical pass over RGBX rows, 16 bytes (four pixels) at a time, two source rows per pmaddwd;
 * each output row is packed to RGB as it is stored. */
static void vertical_pairs(const unsigned char *temp, int out_w, int first_row, const int *bounds, const int32_t *kk,
                           int pairs, int out_h, unsigned char *row, unsigned char *out) {
    size_t line = (size_t)out_w * 4;
    for (int yy = 0; yy < out_h; yy++) {
        const unsigned char *base = temp + line * (size_t)(bounds[2 * yy] - first_row);
        vertical_tail(base, line, 0, kk + (size_t)yy * pairs, bounds[2 * yy + 1], row);
        rgbx_to_rgb(row, out + (size_t)out_w * 3 * (size_t)yy, out_w);
    }
}

/* The same passes on AVX2: two output pixels per register horizontally (one per 128-bit lane),
 * eight pixels per step vertically. Chosen at import when the CPU has AVX2. */
__attribute__((target("avx2"))) static void horizontal_pairs_avx2(const unsigned char *region, size_t stride,
                                                                  int rows, int shift, const int *bounds,
                                                                  const int32_t *kk, int pairs, int out_w, int flip,
                                                                  unsigned char *temp) {
    const __m256i half = _mm256_set1_epi32(1 << (PAIR_BITS - 1));
    /* r0 g0 b0 x0 r1 g1 b1 x1 (int16) -> r0 r1 g0 g1 b0 b1 x0 x1, in each lane */
    const __m256i interleave = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3,
                                                10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    for (int y = 0; y < rows; y++) {
        const unsigned char *src = region + stride * (size_t)y;
        unsigned char *dst = temp + (size_t)out_w * 4 * (size_t)y;
        int xx = 0;
        for (; xx + 2 <= out_w; xx += 2) {
            const unsigned char *p0 = src + (size_t)(bounds[2 * xx] - shift) * 4;
            const unsigned char *p1 = src + (size_t)(bounds[2 * xx + 2] - shift) * 4;
            const int32_t *w0 = kk + (size_t)xx * pairs, *w1 = w0 + pairs;
            int s0 = (bounds[2 * xx + 1] + 1) / 2, s1 = (bounds[2 * xx + 3] + 1) / 2, steps = s0 > s1 ? s0 : s1;
            __m256i acc = half;
            for (int j = 0; j < steps; j++) { /* a pixel's weights past its own taps are zero */
                __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(p0 + 8 * j)),
                                                  _mm_loadl_epi64((const __m128i *)(p1 + 8 * j)));
                __m256i paired = _mm256_shuffle_epi8(_mm256_cvtepu8_epi16(both), interleave);
                __m256i weights = _mm256_set_m128i(_mm_set1_epi32(w1[j]), _mm_set1_epi32(w0[j]));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(paired, weights));
            }
            acc = _mm256_srai_epi32(acc, PAIR_BITS);
            acc = _mm256_packus_epi16(_mm256_packs_epi32(acc, acc), acc);
            int32_t first = _mm_cvtsi128_si32(_mm256_castsi256_si128(acc));
            int32_t second = _mm_cvtsi128_si32(_mm256_extracti128_si256(acc, 1));
            memcpy(dst + (size_t)(flip ? out_w - 1 - xx : xx) * 4, &first, 4);
            memcpy(dst + (size_t)(flip ? out_w - 2 - xx : xx + 1) * 4, &second, 4);
        }
        if (xx < out_w) /* an odd last pixel: the SSE2 pass on this row alone */
            horizontal_pairs(src, stride, 1, shift, bounds + 2 * xx, kk + (size_t)xx * pairs, pairs, 1, 0,
                             dst + (size_t)(flip ? 0 : xx) * 4);
    }
}

__attribute__((target("avx2"))) static void vertical_pairs_avx2(const unsigned char *temp, int out_w, int first_row,
                                                                const int *bounds, const int32_t *kk, int pairs,
                                                                int out_h, unsigned char *row, unsigned char *out) {
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(1 << (PAIR_BITS - 1));
    size_t line = (size_t)out_w * 4;
    for (int yy = 0; yy < out_h; yy++) {
        const unsigned char *base = temp + line * (size_t)(bounds[2 * yy] - first_row);
        const int32_t *w = kk + (size_t)yy * pairs;
        int taps = bounds[2 * yy + 1], steps = (taps + 1) / 2;
        size_t x = 0;
        for (; x + 32 <= line; x += 32) {
            __m256i a0 = half, a1 = half, a2 = half, a3 = half;
            for (int j = 0; j < steps; j++) {
                const unsigned char *r0 = base + line * (size_t)(2 * j) + x;
                const unsigned char *r1 = 2 * j + 1 < taps ? r0 + line : r0;
                __m256i s0 = _mm256_loadu_si256((const __m256i *)r0), s1 = _mm256_loadu_si256((const __m256i *)r1);
                __m256i lo = _mm256_unpacklo_epi8(s0, s1), hi = _mm256_unpackhi_epi8(s0, s1);
                __m256i weight = _mm256_set1_epi32(w[j]);
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), weight));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), weight));
                a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), weight));
                a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), weight));
            }
            __m256i low = _mm256_packs_epi32(_mm256_srai_epi32(a0, PAIR_BITS), _mm256_srai_epi32(a1, PAIR_BITS));
            __m256i high = _mm256_packs_epi32(_mm256_srai_epi32(a2, PAIR_BITS), _mm256_srai_epi32(a3, PAIR_BITS));
            _mm256_storeu_si256((__m256i *)(row + x), _mm256_packus_epi16(low, high));
        }
        if (x < line) /* the last pixels: the SSE2 pass over this row's tail */
            vertical_tail(base, line, x, w, taps, row);
        rgbx_to_rgb(row, out + (size_t)out_w * 3 * (size_t)yy, out_w);
    }
}

typedef void (*HorizontalPass)(const unsigned char *, size_t, int, int, const int *, const int32_t *, int, int, int,
                               unsigned char *);
typedef void (*VerticalPass)(const unsigned char *, int, int, const int *, const int32_t *, int, int, unsigned char *,
                             unsigned char *);
static HorizontalPass horizontal_pass = horizontal_pairs;
static VerticalPass vertical_pass = vertical_pairs;
#endif

/* The portable passes: Pillow's own 22-bit fixed point over RGB rows. Used where there is no SSE2,
 * and on x86-64 with SHARDKIT_CROP_PORTABLE=1 (so that tests cover them). */
#if defined(__SSE2__)
static int portable = 0;
#define PACK_PAIRS pack_pairs
#define HORIZONTAL horizontal_pass
#define VERTICAL vertical_pass
#else
static const int portable = 1;
#define PACK_PAIRS fixed22
#define HORIZONTAL horizontal_plain
#define VERTICAL vertical_plain
#endif
static int fixed22(const double *weights, int count, int ksize, int32_t **kk, size_t *have) {
    if (!grow((void **)kk, have, sizeof(int32_t) * (size_t)count * (size_t)ksize)) return -1;
    for (size_t i = 0; i < (size_t)count * ksize; i++)
        (*kk)[i] = (int32_t)(weights[i] * (1 << PRECISION_BITS) + (weights[i] < 0 ? -0.5 : 0.5));
    return ksize;
}

static void horizontal_plain(const unsigned char *region, size_t stride, int rows, int shift, const int *bounds,
                             const int32_t *kk, int ksize, int out_w, int flip, unsigned char *temp) {
    for (int y = 0; y < rows; y++) {
        const unsigned char *src = region + stride * (size_t)y;
        unsigned char *dst = temp + (size_t)out_w * 3 * (size_t)y;
        for (int xx = 0; xx < out_w; xx++) {
            const unsigned char *p = src + (size_t)(bounds[2 * xx] - shift) * 3;
            const int32_t *k = kk + (size_t)xx * ksize;
            int32_t r = 1 << (PRECISION_BITS - 1), g = r, b = r;
            for (int x = 0; x < bounds[2 * xx + 1]; x++) {
                r += p[3 * x] * k[x];
                g += p[3 * x + 1] * k[x];
                b += p[3 * x + 2] * k[x];
            }
            unsigned char *o = dst + (size_t)(flip ? out_w - 1 - xx : xx) * 3;
            o[0] = clip8(r, PRECISION_BITS);
            o[1] = clip8(g, PRECISION_BITS);
            o[2] = clip8(b, PRECISION_BITS);
        }
    }
}

static void vertical_plain(const unsigned char *temp, int out_w, int first_row, const int *bounds, const int32_t *kk,
                           int ksize, int out_h, int32_t *acc, unsigned char *out) {
    size_t line = (size_t)out_w * 3;
    for (int yy = 0; yy < out_h; yy++) {
        const int32_t *k = kk + (size_t)yy * ksize;
        for (size_t i = 0; i < line; i++) acc[i] = 1 << (PRECISION_BITS - 1);
        for (int y = 0; y < bounds[2 * yy + 1]; y++) {
            const unsigned char *src = temp + line * (size_t)(bounds[2 * yy] - first_row + y);
            for (size_t i = 0; i < line; i++) acc[i] += src[i] * k[y];
        }
        for (size_t i = 0; i < line; i++) out[line * (size_t)yy + i] = clip8(acc[i], PRECISION_BITS);
    }
}

static void fail(Job *job, int status, const char *message) {
    job->status = status;
    snprintf(job->message, sizeof job->message, "%s", message);
}

/* What the filters of one crop need: their taps (xk, yk: per output pixel, in Scratch) and the
 * columns and rows of the source they touch. */
typedef struct {
    int xk, yk;
    int first_col, end_col, first_row, end_row;
} Window;

/* The filters for the box (x0, y0)-(x1, y1) of an in_w x in_h image; 0 when out of memory. */
static int plan(Window *win, int in_w, int in_h, double x0, double y0, double x1, double y1, int out_w, int out_h,
                Scratch *s) {
    int (*fixed)(const double *, int, int, int32_t **, size_t *) = portable ? fixed22 : PACK_PAIRS;
    int xk = coefficients(in_w, x0, x1, out_w, &s->xb, &s->xb_size, s);
    xk = xk < 0 ? -1 : fixed(s->weights, out_w, xk, &s->xk, &s->xk_size);
    int yk = coefficients(in_h, y0, y1, out_h, &s->yb, &s->yb_size, s);
    yk = yk < 0 ? -1 : fixed(s->weights, out_h, yk, &s->yk, &s->yk_size);
    if (xk < 0 || yk < 0) return 0;
    win->xk = xk;
    win->yk = yk;
    win->first_col = s->xb[0];
    win->end_col = 0;
    win->first_row = s->yb[0];
    win->end_row = 0;
    for (int i = 0; i < out_w; i++) {
        if (s->xb[2 * i] < win->first_col) win->first_col = s->xb[2 * i];
        if (s->xb[2 * i] + s->xb[2 * i + 1] > win->end_col) win->end_col = s->xb[2 * i] + s->xb[2 * i + 1];
    }
    for (int i = 0; i < out_h; i++) {
        if (s->yb[2 * i] < win->first_row) win->first_row = s->yb[2 * i];
        if (s->yb[2 * i] + s->yb[2 * i + 1] > win->end_row) win->end_row = s->yb[2 * i] + s->yb[2 * i + 1];
    }
    return 1;
}

/* Bytes a paired horizontal pass may read past the window's last row: the lanes of a register
 * step as far as the widest filter in it, so the last pixels of a row (fewer taps at the image's
 * edge) read up to a whole filter's width of weightless pixels beyond it (8 bytes a tap pair, RGBX),
 * which for a raw record downscaled 36x is ~70 taps, past any fixed slack. */
static size_t slack(const Window *win) { return 8 * (size_t)win->xk + 64; }

/* The two passes over `region` (the window's rows from first_row, `stride` bytes apart, column 0 of
 * the region being source column `shift`) into job->out: the portable ones over RGB rows (`plain`),
 * else the paired ones over RGBX. 0 when out of memory. */
static int resample(Job *job, const Window *win, const unsigned char *region, size_t stride, int shift, int out_w,
                    int out_h, int plain, Scratch *s) {
    int rows = win->end_row - win->first_row, channels = plain ? 3 : 4;
    if (!grow((void **)&s->temp, &s->temp_size, (size_t)out_w * channels * (size_t)rows) ||
        !grow((void **)&s->row, &s->row_size, sizeof(int32_t) * (size_t)out_w * 4))
        return 0;
    if (plain) {
        horizontal_plain(region, stride, rows, shift, s->xb, s->xk, win->xk, out_w, job->flip, s->temp);
        vertical_plain(s->temp, out_w, win->first_row, s->yb, s->yk, win->yk, out_h, s->row, job->out);
    }
#if defined(__SSE2__)
    else {
        HORIZONTAL(region, stride, rows, shift, s->xb, s->xk, win->xk, out_w, job->flip, s->temp);
        VERTICAL(s->temp, out_w, win->first_row, s->yb, s->yk, win->yk, out_h, (unsigned char *)s->row, job->out);
    }
#endif
    return 1;
}

static void crop_decode(Job *job, int out_w, int out_h, unsigned long long max_pixels, Scratch *s) {
    struct jpeg_decompress_struct cinfo;
    Errors errors;
    job->status = OK;
    job->message[0] = '\0';
    cinfo.err = jpeg_std_error(&errors.pub);
    errors.pub.error_exit = on_error;
    errors.pub.emit_message = on_message;
    errors.job = job;
    if (setjmp(errors.jump)) {
        job->status = FAILED;
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->size);
    jpeg_read_header(&cinfo, TRUE);
    if ((unsigned long long)cinfo.image_width * cinfo.image_height > max_pixels) {
        snprintf(job->message, sizeof job->message, "%ux%u is over the limit of %llu pixels", cinfo.image_width,
                 cinfo.image_height, max_pixels);
        job->status = FAILED;
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK || cinfo.num_components == 2) {
        fail(job, UNSUPPORTED, "not an RGB or grey JPEG");
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    double left = job->box[0], top = job->box[1], width = job->box[2], height = job->box[3];
    if (!(width > 0 && height > 0 && left >= 0 && top >= 0 && left + width <= cinfo.image_width + 1e-6 &&
          top + height <= cinfo.image_height + 1e-6)) {
        fail(job, FAILED, "crop box outside the image");
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    int denom = 1;
    for (int d = 8; d > 1; d /= 2)
        if (width / d >= out_w && height / d >= out_h) {
            denom = d;
            break;
        }
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    int channels = portable ? 3 : 4;
    cinfo.out_color_space = portable ? JCS_RGB : JCS_EXT_RGBX;
    jpeg_start_decompress(&cinfo);
    int scaled_w = (int)cinfo.output_width, scaled_h = (int)cinfo.output_height;
    double x0 = left / denom, y0 = top / denom, x1 = (left + width) / denom, y1 = (top + height) / denom;
    if (x1 > scaled_w) x1 = scaled_w;
    if (y1 > scaled_h) y1 = scaled_h;

    Window win;
    if (!plan(&win, scaled_w, scaled_h, x0, y0, x1, y1, out_w, out_h, s)) {
        fail(job, FAILED, "out of memory");
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    JDIMENSION xoffset = (JDIMENSION)win.first_col, crop_width = (JDIMENSION)(win.end_col - win.first_col);
    if (xoffset > 0 || crop_width < (JDIMENSION)scaled_w)
        jpeg_crop_scanline(&cinfo, &xoffset, &crop_width); /* widened to whole iMCU columns */
    size_t stride = (size_t)crop_width * channels;
    int rows = win.end_row - win.first_row;
    if (!grow((void **)&s->region, &s->region_size, stride * (size_t)rows + slack(&win))) {
        fail(job, FAILED, "out of memory");
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    if (win.first_row > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)win.first_row);
    while ((int)cinfo.output_scanline < win.end_row) {
        JSAMPROW line = s->region + stride * (cinfo.output_scanline - (JDIMENSION)win.first_row);
        jpeg_read_scanlines(&cinfo, &line, 1);
    }
    jpeg_destroy_decompress(&cinfo); /* the rows below the box are never decoded */
    if (!resample(job, &win, s->region, stride, (int)xoffset, out_w, out_h, portable, s))
        fail(job, FAILED, "out of memory");
}

/* A raw record: raw_w x raw_h RGB pixels at job->data (the caller checked that they are all there).
 * Nothing to decode and no DCT scaling: the filter reads the box's rows where they lie (the portable
 * passes, over RGB), or a copy of the box's window as RGBX (the paired passes; the only copy made). */
static void crop_raw(Job *job, int out_w, int out_h, Scratch *s) {
    job->status = OK;
    job->message[0] = '\0';
    double left = job->box[0], top = job->box[1], width = job->box[2], height = job->box[3];
    if (!(width > 0 && height > 0 && left >= 0 && top >= 0 && left + width <= job->raw_w + 1e-6 &&
          top + height <= job->raw_h + 1e-6)) {
        fail(job, FAILED, "crop box outside the image");
        return;
    }
    double x1 = left + width > job->raw_w ? job->raw_w : left + width;
    double y1 = top + height > job->raw_h ? job->raw_h : top + height;
    Window win;
    if (!plan(&win, job->raw_w, job->raw_h, left, top, x1, y1, out_w, out_h, s)) {
        fail(job, FAILED, "out of memory");
        return;
    }
    size_t line = (size_t)job->raw_w * 3;
    const unsigned char *first = job->data + line * (size_t)win.first_row;
    int rows = win.end_row - win.first_row, ok;
    if (portable) {
        ok = resample(job, &win, first, line, 0, out_w, out_h, 1, s);
    } else {
        int cols = win.end_col - win.first_col;
        size_t stride = (size_t)cols * 4;
        ok = grow((void **)&s->region, &s->region_size, stride * (size_t)rows + slack(&win));
        for (int y = 0; ok && y < rows; y++)
            rgb_to_rgbx(first + line * (size_t)y + (size_t)win.first_col * 3, s->region + stride * (size_t)y, cols);
        ok = ok && resample(job, &win, s->region, stride, win.first_col, out_w, out_h, 0, s);
    }
    if (!ok) fail(job, FAILED, "out of memory");
}

/* decode_batch and crop_raw_batch: `geometry` (raw records only: int64 offset, width, height per
 * record) is NULL for JPEGs. */
static PyObject *run_batch(PyObject *datas_arg, Py_buffer *geometry, Py_buffer boxes, Py_buffer flips, Py_buffer rows,
                           Py_buffer out, int out_h, int out_w, unsigned long long max_pixels) {
    PyObject *result = NULL, *datas = PySequence_Tuple(datas_arg);
    Py_ssize_t n = datas ? PyTuple_GET_SIZE(datas) : 0;
    Py_buffer *views = NULL;
    Job *jobs = NULL;
    Py_ssize_t held = 0;
    if (datas == NULL) goto done;
    Py_ssize_t image_bytes = (Py_ssize_t)out_h * out_w * 3;
    if (out_h < 1 || out_w < 1 || boxes.len != n * 4 * (Py_ssize_t)sizeof(double) || flips.len != n ||
        rows.len != n * (Py_ssize_t)sizeof(int32_t) || out.len % image_bytes != 0 ||
        (geometry != NULL && geometry->len != n * 3 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "crop kernel: sizes of boxes, flips, rows, geometry or out do not match");
        goto done;
    }
    const int32_t *row = rows.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (row[i] < 0 || row[i] >= out.len / image_bytes) {
            PyErr_SetString(PyExc_ValueError, "crop kernel: a row outside out");
            goto done;
        }
    views = PyMem_Calloc((size_t)n + 1, sizeof *views);
    jobs = PyMem_Calloc((size_t)n + 1, sizeof *jobs);
    if (views == NULL || jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const double *box = boxes.buf;
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(datas, held), &views[held], PyBUF_SIMPLE) < 0) goto done;
        Job *job = &jobs[held];
        job->data = views[held].buf;
        job->size = (size_t)views[held].len;
        if (geometry != NULL) { /* the pixels must all be in the buffer: checked here, not trusted */
            const int64_t *g = (const int64_t *)geometry->buf + 3 * held;
            if (g[0] < 0 || g[1] < 1 || g[2] < 1 || g[1] > INT_MAX / 3 || g[2] > INT_MAX ||
                (unsigned long long)g[1] * (unsigned long long)g[2] > max_pixels ||
                (unsigned long long)g[0] + (unsigned long long)g[1] * (unsigned long long)g[2] * 3 > job->size) {
                held++;
                PyErr_SetString(PyExc_ValueError, "crop_raw_batch: a record's geometry outside its bytes");
                goto done;
            }
            job->data += g[0];
            job->raw_w = (int)g[1];
            job->raw_h = (int)g[2];
        }
        memcpy(job->box, box + 4 * held, sizeof job->box);
        job->flip = ((const unsigned char *)flips.buf)[held] != 0;
        job->out = (unsigned char *)out.buf + (size_t)row[held] * (size_t)image_bytes;
    }
    Py_BEGIN_ALLOW_THREADS;
    Scratch scratch = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        if (geometry != NULL)
            crop_raw(&jobs[i], out_w, out_h, &scratch);
        else
            crop_decode(&jobs[i], out_w, out_h, max_pixels, &scratch);
    }
    free(scratch.region);
    free(scratch.temp);
    free(scratch.weights);
    free(scratch.xk);
    free(scratch.yk);
    free(scratch.row);
    free(scratch.xb);
    free(scratch.yb);
    Py_END_ALLOW_THREADS;
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = jobs[i].status == OK ? Py_NewRef(Py_None)
                                              : Py_BuildValue("(is)", jobs[i].status, jobs[i].message);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, item);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(jobs);
    Py_XDECREF(datas);
    return result;
}

static PyObject *decode_batch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *datas;
    Py_buffer boxes, flips, rows, out;
    int out_h, out_w;
    unsigned long long max_pixels;
    if (!PyArg_ParseTuple(args, "Oy*y*y*w*iiK:decode_batch", &datas, &boxes, &flips, &rows, &out, &out_h, &out_w,
                          &max_pixels))
        return NULL;
    PyObject *result = run_batch(datas, NULL, boxes, flips, rows, out, out_h, out_w, max_pixels);
    PyBuffer_Release(&boxes);
    PyBuffer_Release(&flips);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *crop_raw_batch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *datas;
    Py_buffer geometry, boxes, flips, rows, out;
    int out_h, out_w;
    unsigned long long max_pixels;
    if (!PyArg_ParseTuple(args, "Oy*y*y*y*w*iiK:crop_raw_batch", &datas, &geometry, &boxes, &flips, &rows, &out,
                          &out_h, &out_w, &max_pixels))
        return NULL;
    PyObject *result = run_batch(datas, &geometry, boxes, flips, rows, out, out_h, out_w, max_pixels);
    PyBuffer_Release(&geometry);
    PyBuffer_Release(&boxes);
    PyBuffer_Release(&flips);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

/* headers.jpeg_size, line for line: (width, height) from the first frame header of a JPEG whose
 * segments are laid out plainly, or -1, -1 where Python's parser must have the last word. */
static void jpeg_size(const unsigned char *data, Py_ssize_t length, int64_t *size) {
    size[0] = size[1] = -1;
    Py_ssize_t pos = 2, end = length - 9;
    while (pos < end) {
        if (data[pos] != 0xFF) return;
        int marker = data[pos + 1];
        if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
            size[0] = ((int64_t)data[pos + 7] << 8) | data[pos + 8];
            size[1] = ((int64_t)data[pos + 5] << 8) | data[pos + 6];
            return;
        }
        if (marker == 0xFF) pos += 1;
        else if (marker == 0xDA || marker == 0xD9 || (marker >= 0xD0 && marker <= 0xD8) || marker == 0x01) return;
        else pos += 2 + (((Py_ssize_t)data[pos + 2] << 8) | data[pos + 3]);
    }
}

static PyObject *jpeg_sizes(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *datas;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "O!w*:jpeg_sizes", &PyList_Type, &datas, &out)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(datas);
    PyObject *result = NULL;
    if (out.len != count * 2 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "jpeg_sizes: out must hold 2 int64 per data");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyList_GET_ITEM(datas, i);
        int64_t *size = (int64_t *)out.buf + 2 * i;
        if (PyBytes_Check(data)) jpeg_size((const unsigned char *)PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), size);
        else size[0] = size[1] = -1; /* (Python's parser reads other buffers) */
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_batch", decode_batch, METH_VARARGS,
     "decode_batch(datas, boxes, flips, rows, out, height, width, max_pixels) -> list: JPEG i's crop box (float64 "
     "left, top, width, height in boxes[4i:4i+4]) resized to height x width RGB into out[rows[i]] (int32 rows; out "
     "uint8 M x H x W x 3), mirrored when flips[i]; per image None, or (status, message): 1 failed, 2 unsupported "
     "(use the Python path)."},
    {"crop_raw_batch", crop_raw_batch, METH_VARARGS,
     "crop_raw_batch(datas, geometry, boxes, flips, rows, out, height, width, max_pixels) -> list: as decode_batch, "
     "for raw records: record i's pixels are geometry[3i+1] x geometry[3i+2] RGB (uint8, rows of width * 3 bytes) "
     "starting at byte geometry[3i] of datas[i] (int64 geometry); no DCT scaling."},
    {"jpeg_sizes", jpeg_sizes, METH_VARARGS,
     "jpeg_sizes(datas, out) -> None: headers.jpeg_size of each bytes in the list datas into out (int64, 2 per "
     "data: width, height), -1, -1 where it gives None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__crop(void) {
#if defined(__SSE2__)
    portable = getenv("SHARDKIT_CROP_PORTABLE") != NULL;
#endif
#if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("ssse3")) {
        rgbx_to_rgb = rgbx_to_rgb_ssse3;
        rgb_to_rgbx = rgb_to_rgbx_ssse3;
    }
    if (__builtin_cpu_supports("avx2") && !getenv("SHARDKIT_NO_AVX2")) {
        horizontal_pass = horizontal_pairs_avx2;
        vertical_pass = vertical_pairs_avx2;
    }
#endif
    return PyModule_Create(&module);
}
