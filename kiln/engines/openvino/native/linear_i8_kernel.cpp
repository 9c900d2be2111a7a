#include "linear_i8_kernel.h"

#include <immintrin.h>
#include <openvino/core/parallel.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln_ov {
namespace {

constexpr size_t ROWS = 8;      // rows per tile (tile() says why 8 x 3)
constexpr size_t COLS = 3;      // 16-column vectors per tile
constexpr size_t FEW_ROWS = 64; // up to here every worker quantizes all rows itself (no second dispatch)
constexpr size_t PREFETCH_L1_BYTES = 16384;   // a row tile's share of the next panel that goes to L1

// One row times its channels' smoothing factors, quantized: one scale (absmax / 127), codes shifted
// by 128 into u8; padding codes 128 (their weights are zero).
float quantize_row(const float* x, const float* sm, size_t K, size_t Kp, uint8_t* q) {
    __m512 vmax = _mm512_setzero_ps();
    size_t k = 0;
    for (; k + 16 <= K; k += 16)
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(sm + k))));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k] * sm[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / s);
    for (k = 0; k + 16 <= K; k += 16) {
        const __m512 xs = _mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(sm + k));
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(xs, inv), _MM_FROUND_TO_NEAREST_INT);
        const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(128));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtusepi32_epi8(v));
    }
    for (; k < K; ++k) q[k] = static_cast<uint8_t>(std::nearbyint(x[k] * sm[k] / s) + 128.f);
    for (k = K; k < Kp; ++k) q[k] = 128;
    return s;
}

void quantize_rows(const float* x, const float* sm, size_t M, size_t K, size_t Kp, uint8_t* q, float* scale) {
    for (size_t m = 0; m < M; ++m) scale[m] = quantize_row(x + m * K, sm, K, Kp, q + m * Kp);
}

// An R x (16 J) tile of y over all of K: up to 8 x 3 int32 sums in named accumulators (GCC keeps an
// array of vectors on the stack), 3 weight vectors and a broadcast per step of 4 k: 28 of the 32
// registers. Each weight vector serves 8 rows, so a panel is read from cache M / 8 times per call.
template <int R, int J>
void tile(const uint8_t* q, size_t Kp, const float* qs, const int8_t* w, size_t panel, size_t K4,
          const float* ws, const float* comp, float* y, size_t ldy, const int8_t* pf, size_t pf_lines) {
    // pf: pf_lines cache lines of the next panel, asked for a few per step of k, so the requests
    // spread over the multiply instead of queueing at its start; into L1 where they fit beside the
    // panel in use (at 32 rows, a quarter panel: 3 % faster calls than into L2), else into L2 (one
    // row tile asks for a whole panel: into L1 it would evict the one being read)
    const size_t per_step = (pf_lines + K4 - 1) / K4;
    const bool into_l1 = pf_lines * 64 <= PREFETCH_L1_BYTES;
    const int8_t* w0p = w;
    const int8_t* w1p = w + panel;
    const int8_t* w2p = w + 2 * panel;
    // NOTE: each sum starts at minus the shift's share (128 x the column's codes), so the int32 sum is
    // exactly x . w.
    const __m512i c0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_cvtps_epi32(_mm512_loadu_ps(comp)));
    __m512i c1 = c0, c2 = c0;
    if constexpr (J > 1) c1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_cvtps_epi32(_mm512_loadu_ps(comp + 16)));
    if constexpr (J > 2) c2 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_cvtps_epi32(_mm512_loadu_ps(comp + 32)));
    __m512i a00 = c0, a01 = c1, a02 = c2, a10 = c0, a11 = c1, a12 = c2, a20 = c0, a21 = c1, a22 = c2,
            a30 = c0, a31 = c1, a32 = c2, a40 = c0, a41 = c1, a42 = c2, a50 = c0, a51 = c1, a52 = c2,
            a60 = c0, a61 = c1, a62 = c2, a70 = c0, a71 = c1, a72 = c2;
#define KILN_ROW(r)                                                                                  \
    if constexpr (R > r) {                                                                           \
        __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q + r * Kp + k4 * 4));     \
        a##r##0 = _mm512_dpbusd_epi32(a##r##0, xb, w0);                                              \
        if constexpr (J > 1) a##r##1 = _mm512_dpbusd_epi32(a##r##1, xb, w1);                         \
        if constexpr (J > 2) a##r##2 = _mm512_dpbusd_epi32(a##r##2, xb, w2);                         \
    }
    for (size_t k4 = 0; k4 < K4; ++k4) {
        for (size_t l = k4 * per_step, e = std::min(pf_lines, l + per_step); l < e; ++l) {
            if (into_l1)
                _mm_prefetch(reinterpret_cast<const char*>(pf + l * 64), _MM_HINT_T0);
            else
                _mm_prefetch(reinterpret_cast<const char*>(pf + l * 64), _MM_HINT_T1);
        }
        __m512i w0 = _mm512_loadu_si512(w0p + k4 * 64), w1 = w0, w2 = w0;
        if constexpr (J > 1) w1 = _mm512_loadu_si512(w1p + k4 * 64);
        if constexpr (J > 2) w2 = _mm512_loadu_si512(w2p + k4 * 64);
        KILN_ROW(0) KILN_ROW(1) KILN_ROW(2) KILN_ROW(3) KILN_ROW(4) KILN_ROW(5) KILN_ROW(6) KILN_ROW(7)
    }
#undef KILN_ROW
    const __m512i a[8][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32},
                             {a40, a41, a42}, {a50, a51, a52}, {a60, a61, a62}, {a70, a71, a72}};
    for (int j = 0; j < J; ++j) {
        const __m512 vs = _mm512_loadu_ps(ws + j * 16);
        for (int r = 0; r < R; ++r)
            _mm512_storeu_ps(y + r * ldy + j * 16,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(a[r][j]), _mm512_mul_ps(vs, _mm512_set1_ps(qs[r]))));
    }
}

template <int R>
void tile_j(int J, const uint8_t* q, size_t Kp, const float* qs, const int8_t* w, size_t panel, size_t K4,
            const float* ws, const float* comp, float* y, size_t ldy, const int8_t* pf, size_t pf_lines) {
    switch (J) {
        case 3: return tile<R, 3>(q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 2: return tile<R, 2>(q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        default: return tile<R, 1>(q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
    }
}

void tile_rj(size_t R, int J, const uint8_t* q, size_t Kp, const float* qs, const int8_t* w, size_t panel,
             size_t K4, const float* ws, const float* comp, float* y, size_t ldy, const int8_t* pf, size_t pf_lines) {
    switch (R) {
        case 8: return tile_j<8>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 7: return tile_j<7>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 6: return tile_j<6>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 5: return tile_j<5>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 4: return tile_j<4>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 3: return tile_j<3>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        case 2: return tile_j<2>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
        default: return tile_j<1>(J, q, Kp, qs, w, panel, K4, ws, comp, y, ldy, pf, pf_lines);
    }
}

// exp(x), x clamped below at -87: 2^n * p(f), a degree-5 polynomial in f (relative error ~2e-7).
__m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
    __m512 p = _mm512_set1_ps(1.f / 120);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

void swiglu(const float* g, const float* u, size_t R, int J, float* y, size_t ldy) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (size_t r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) {
            const __m512 gv = _mm512_loadu_ps(g + r * 16 * COLS + j * 16), uv = _mm512_loadu_ps(u + r * 16 * COLS + j * 16);
            const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_storeu_ps(y + r * ldy + j * 16, _mm512_mul_ps(_mm512_mul_ps(gv, sig), uv));
        }
}

// Part i of parts of the next panel: the lines a row tile asks for while it multiplies this one. The
// weights come from memory once per call (a model's linears exceed the caches), and the hardware
// prefetcher starts over at every panel, since each row tile reads the panel again.
struct Prefetch {
    const int8_t* at;
    size_t lines;
};

Prefetch next_part(const int8_t* next, size_t bytes, size_t i, size_t parts) {
    if (next == nullptr) return {nullptr, 0};
    const size_t lines = (bytes + 63) / 64, first = lines * i / parts, last = lines * (i + 1) / parts;
    return {next + first * 64, last - first};
}

struct Rows {
    const uint8_t* q;
    const float* scale;
};

// Runs body(rows, first 48-column tile, end) on each worker over its share of the column tiles. Many
// rows are quantized once; few are quantized by each worker for itself (a second parallel dispatch
// would cost more than quantizing 64 rows twice).
template <typename Body>
void for_column_tiles(const float* x, const float* sm, size_t M, size_t K, size_t Kp, size_t tiles, Body body) {
    thread_local std::vector<uint8_t> shared_q;
    thread_local std::vector<float> shared_s;
    Rows shared{nullptr, nullptr};
    if (M > FEW_ROWS) {
        shared_q.resize(M * Kp);
        shared_s.resize(M);
        uint8_t* q = shared_q.data();
        float* s = shared_s.data();
        ov::parallel_for(M, [&](size_t m) { s[m] = quantize_row(x + m * K, sm, K, Kp, q + m * Kp); });
        shared = {q, s};
    }
    ov::parallel_nt(0, [&](int ithr, int nthr) {
        size_t start = 0, end = 0;
        ov::splitter(tiles, nthr, ithr, start, end);
        if (start >= end) return;
        Rows rows = shared;
        thread_local std::vector<uint8_t> own_q;
        thread_local std::vector<float> own_s;
        if (rows.q == nullptr) {
            own_q.resize(M * Kp);
            own_s.resize(M);
            quantize_rows(x, sm, M, K, Kp, own_q.data(), own_s.data());
            rows = {own_q.data(), own_s.data()};
        }
        body(rows, start, end);
    });
}

// The panels of one call: K4 steps of 64 bytes per 16 columns; tile t covers columns 48 t ...
struct Panels {
    size_t Kp, K4, panel, blocks, tiles;
    Panels(size_t K, size_t N)
        : Kp((K + 3) / 4 * 4), K4(Kp / 4), panel(K4 * 64), blocks(N / 16), tiles((blocks + COLS - 1) / COLS) {}
    int columns(size_t t) const { return static_cast<int>(std::min(COLS, blocks - t * COLS)); }
    size_t bytes(size_t t) const { return t < tiles ? columns(t) * panel : 0; }
    const int8_t* at(const int8_t* codes, size_t t) const { return codes + t * COLS * panel; }
};

}  // namespace

void linear_i8(const float* x, const float* sm, size_t M, size_t K, PackedLinear w, size_t N, float* y) {
    const Panels p(K, N);
    const size_t parts = (M + ROWS - 1) / ROWS;
    for_column_tiles(x, sm, M, K, p.Kp, p.tiles, [&](Rows rows, size_t start, size_t end) {
        for (size_t t = start; t < end; ++t) {
            const size_t b = t * COLS;
            const int8_t* next = t + 1 < end ? p.at(w.codes, t + 1) : nullptr;
            for (size_t m0 = 0; m0 < M; m0 += ROWS) {
                const Prefetch pf = next_part(next, p.bytes(t + 1), m0 / ROWS, parts);
                tile_rj(std::min(ROWS, M - m0), p.columns(t), rows.q + m0 * p.Kp, p.Kp, rows.scale + m0,
                        p.at(w.codes, t), p.panel, p.K4, w.scale + b * 16, w.comp + b * 16, y + m0 * N + b * 16, N,
                        pf.at, pf.lines);
            }
        }
    });
}

void gate_up_i8(const float* x, const float* sm, size_t M, size_t K, PackedLinear gate, PackedLinear up, size_t N, float* y) {
    const Panels p(K, N);
    const size_t parts = (M + ROWS - 1) / ROWS;
    for_column_tiles(x, sm, M, K, p.Kp, p.tiles, [&](Rows rows, size_t start, size_t end) {
        alignas(64) float g[ROWS * 16 * COLS], u[ROWS * 16 * COLS];
        for (size_t t = start; t < end; ++t) {
            const size_t b = t * COLS;
            const int J = p.columns(t);
            const bool more = t + 1 < end;
            for (size_t m0 = 0; m0 < M; m0 += ROWS) {
                const size_t R = std::min(ROWS, M - m0);
                const Prefetch pg = next_part(more ? p.at(gate.codes, t + 1) : nullptr, p.bytes(t + 1), m0 / ROWS, parts);
                const Prefetch pu = next_part(more ? p.at(up.codes, t + 1) : nullptr, p.bytes(t + 1), m0 / ROWS, parts);
                tile_rj(R, J, rows.q + m0 * p.Kp, p.Kp, rows.scale + m0, p.at(gate.codes, t), p.panel, p.K4,
                        gate.scale + b * 16, gate.comp + b * 16, g, 16 * COLS, pg.at, pg.lines);
                tile_rj(R, J, rows.q + m0 * p.Kp, p.Kp, rows.scale + m0, p.at(up.codes, t), p.panel, p.K4,
                        up.scale + b * 16, up.comp + b * 16, u, 16 * COLS, pu.at, pu.lines);
                swiglu(g, u, R, J, y + m0 * N + b * 16, N);
            }
        }
    });
}

}  // namespace kiln_ov
