// Prefill attention over an F16 cache, tiled: a block takes AP_TQ query tokens of one head
// and walks the union of their spans in tiles of AP_TC cells, each tile's keys and values
// read from memory once into shared memory and used by every query of the block, with a
// running (online) softmax per query. The per-token kernel (attention.cu) reads each
// token's whole span itself, which for a 512-token prompt is ~256 times the cache bytes.

#define AP_TQ 16     // query tokens a block takes
#define AP_TC 64     // cells a tile holds
#define AP_WARPS 4   // each warp takes AP_TQ / AP_WARPS queries
#define AP_QW (AP_TQ / AP_WARPS)

// The two f16 halves of w (low first) as floats.
__device__ __forceinline__ float2 h2f2(u32 w) {
    return make_float2(h2f((u16)(w & 0xffff)), h2f((u16)(w >> 16)));
}

// out[t][h] = softmax over the cells of spans[t] (pairs first_cell, n_cells of virtual cells:
// in a ring when ring > 0, through the block table `blocks` when not null, see kv_cell) of
// cap_score(scale * q[t][h] . k[cell][kh], softcap), applied to v[cell][kh];
// kh = h / (n_heads / n_kv_heads),
// cache rows [n_kv_heads][D] f16. A token with no cells gets zeros.
// Launch: grid (n_heads, ceil(n_tokens / AP_TQ)), 128 threads, no dynamic shared memory.
// D is 64, 96 or 128. Queries are handled by their warp: lanes take 2 cells each for the
// scores and up to COLS half2 columns each for the values (lane + 32 c, while under D / 2).
template <int D>
__device__ __forceinline__ void attention_prefill(const float* __restrict__ q,
                                                  const u16* __restrict__ k,
                                                  const u16* __restrict__ v,
                                                  const u32* __restrict__ spans, u32 ring,
                                                  const u32* __restrict__ blocks,
                                                  int n_tokens,
                                                  int n_heads, int n_kv_heads, float scale,
                                                  float softcap, float* __restrict__ out) {
    constexpr int H2 = D / 2;         // half2 columns of a row
    constexpr int KS = H2 + 1;        // key row stride in words: lanes on 32 rows, 32 banks
    constexpr int COLS = (H2 + 31) / 32;  // half2 columns a lane owns in the value pass
    __shared__ u32 ks[AP_TC * KS];
    __shared__ __align__(16) u32 vs[AP_TC * H2];
    __shared__ __align__(8) float qs[AP_TQ * D];
    __shared__ float ps[AP_WARPS][AP_QW][AP_TC];

    int h = blockIdx.x, t0 = blockIdx.y * AP_TQ;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kh = h / (n_heads / n_kv_heads);
    u64 row_words = (u64)n_kv_heads * H2;  // 32-bit words of one cache cell

    // The block's cells: the union of its tokens' spans.
    u32 lo = 0xffffffffu, hi = 0;
    for (int i = 0; i < AP_TQ && t0 + i < n_tokens; i++) {
        u32 f = spans[2 * (t0 + i)], n = spans[2 * (t0 + i) + 1];
        if (n > 0) {
            lo = min(lo, f);
            hi = max(hi, f + n);
        }
    }
    for (int i = threadIdx.x; i < AP_TQ * D; i += blockDim.x) {
        int t = t0 + i / D;
        qs[i] = t < n_tokens ? q[((u64)t * n_heads + h) * D + i % D] * scale : 0.f;
    }

    // This warp's queries: cell range, running max and sum, output accumulators.
    u32 first[AP_QW], end[AP_QW];
    float m[AP_QW], l[AP_QW], acc[AP_QW][COLS][2];
#pragma unroll
    for (int j = 0; j < AP_QW; j++) {
        int t = t0 + warp * AP_QW + j;
        first[j] = t < n_tokens ? spans[2 * t] : 0;
        end[j] = t < n_tokens ? first[j] + spans[2 * t + 1] : 0;
        m[j] = NEG_INF;
        l[j] = 0.f;
#pragma unroll
        for (int c = 0; c < COLS; c++) acc[j][c][0] = acc[j][c][1] = 0.f;
    }

    const u32* kw = (const u32*)k + (u64)kh * H2;
    const u32* vw = (const u32*)v + (u64)kh * H2;
    for (u32 c0 = lo; c0 < hi; c0 += AP_TC) {
        // Every warp is done with the previous tile (and, the first time, qs is written).
        __syncthreads();
        for (int i = threadIdx.x; i < AP_TC * H2 / 4; i += blockDim.x) {
            int cell = i / (H2 / 4), w4 = (i % (H2 / 4)) * 4;
            // Cells past the union are read from its last cell and masked below.
            u64 at = (u64)kv_cell(min(c0 + cell, hi - 1), ring, blocks) * row_words + w4;
            uint4 kq = *(const uint4*)(kw + at);
            uint4 vq = *(const uint4*)(vw + at);
            u32* kd = ks + cell * KS + w4;
            kd[0] = kq.x;
            kd[1] = kq.y;
            kd[2] = kq.z;
            kd[3] = kq.w;
            *(uint4*)(vs + cell * H2 + w4) = vq;
        }
        __syncthreads();

        // Scores of this lane's two cells for each query of the warp.
        float s[AP_QW][2];
#pragma unroll
        for (int j = 0; j < AP_QW; j++) s[j][0] = s[j][1] = 0.f;
        const float* qw = qs + warp * AP_QW * D;
#pragma unroll 8
        for (int w = 0; w < H2; w++) {
            float2 ka = h2f2(ks[lane * KS + w]);
            float2 kb = h2f2(ks[(lane + 32) * KS + w]);
#pragma unroll
            for (int j = 0; j < AP_QW; j++) {
                float2 qv = *(const float2*)(qw + j * D + 2 * w);
                s[j][0] += qv.x * ka.x + qv.y * ka.y;
                s[j][1] += qv.x * kb.x + qv.y * kb.y;
            }
        }
#pragma unroll
        for (int j = 0; j < AP_QW; j++) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 cell = c0 + lane + 32 * i;
                s[j][i] = cap_score(s[j][i], softcap);
                if (cell < first[j] || cell >= end[j]) s[j][i] = NEG_INF;
            }
            float mt = warp_max(fmaxf(s[j][0], s[j][1]));
            float mn = fmaxf(m[j], mt);
            // No cell of this query so far: nothing to add (and no inf - inf).
            float p0 = 0.f, p1 = 0.f, corr = 1.f;
            if (mn != NEG_INF) {
                p0 = expf(s[j][0] - mn);
                p1 = expf(s[j][1] - mn);
                corr = expf(m[j] - mn);
            }
            m[j] = mn;
            l[j] = l[j] * corr + warp_sum(p0 + p1);
#pragma unroll
            for (int c = 0; c < COLS; c++) {
                acc[j][c][0] *= corr;
                acc[j][c][1] *= corr;
            }
            ps[warp][j][lane] = p0;
            ps[warp][j][lane + 32] = p1;
        }
        __syncwarp();

        // Values: each lane its columns, every cell of the tile, every query of the warp.
#pragma unroll 4
        for (int cell = 0; cell < AP_TC; cell++) {
            float2 vv[COLS];
#pragma unroll
            for (int c = 0; c < COLS; c++)
                vv[c] = lane + 32 * c < H2 ? h2f2(vs[cell * H2 + lane + 32 * c]) : make_float2(0.f, 0.f);
#pragma unroll
            for (int j = 0; j < AP_QW; j++) {
                float p = ps[warp][j][cell];
#pragma unroll
                for (int c = 0; c < COLS; c++) {
                    acc[j][c][0] += p * vv[c].x;
                    acc[j][c][1] += p * vv[c].y;
                }
            }
        }
    }

#pragma unroll
    for (int j = 0; j < AP_QW; j++) {
        int t = t0 + warp * AP_QW + j;
        if (t >= n_tokens) continue;
        float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        float* o = out + ((u64)t * n_heads + h) * D;
#pragma unroll
        for (int c = 0; c < COLS; c++) {
            int d = 2 * (lane + 32 * c);
            if (d < D) *(float2*)(o + d) = make_float2(acc[j][c][0] * inv, acc[j][c][1] * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
    attention_prefill_64(const float* q, const u16* k, const u16* v, const u32* spans, u32 ring,
                         const u32* blocks,
                         int n_tokens, int n_heads, int n_kv_heads, float scale, float softcap,
                         float* out) {
    PDL_ENTRY();
    attention_prefill<64>(q, k, v, spans, ring, blocks, n_tokens, n_heads, n_kv_heads, scale,
                           softcap, out);
}

// Phi-3's heads.
extern "C" __global__ void __launch_bounds__(128)
    attention_prefill_96(const float* q, const u16* k, const u16* v, const u32* spans, u32 ring,
                         const u32* blocks,
                         int n_tokens, int n_heads, int n_kv_heads, float scale, float softcap,
                         float* out) {
    PDL_ENTRY();
    attention_prefill<96>(q, k, v, spans, ring, blocks, n_tokens, n_heads, n_kv_heads, scale,
                           softcap, out);
}

extern "C" __global__ void __launch_bounds__(128)
    attention_prefill_128(const float* q, const u16* k, const u16* v, const u32* spans, u32 ring,
                          const u32* blocks,
                          int n_tokens, int n_heads, int n_kv_heads, float scale, float softcap,
                         float* out) {
    PDL_ENTRY();
    attention_prefill<128>(q, k, v, spans, ring, blocks, n_tokens, n_heads, n_kv_heads, scale,
                           softcap, out);
}
