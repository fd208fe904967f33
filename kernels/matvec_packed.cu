// Decode products over Q4_0 and Q8_0 weights in the packed layout, with activations in
// 8-bit blocks (values xq [nt][cols], (scale, scale * sum) pairs xds [nt][cols / 32]), as
// the cpu backend (and llama.cpp) multiply them. f32 activations were tried for Q8_0: a
// lane's 128 bytes of x per block make every warp load touch 32 cache lines, 2.4x slower.
//
// The packed layout (made in place by pack_q4_0 / pack_q8_0, same bytes per row as GGUF's):
// every 8 consecutive blocks of a row become one group: their 8 f16 scales (16 bytes), then
// their quants (16 bytes a block for Q4_0, nibbles in GGUF's order; 32 for Q8_0). GGUF's
// 18- and 34-byte blocks allow only 2-byte loads; here a lane reads one block's quants in
// one (Q4_0) or two (Q8_0) 16-byte loads, and a warp reads 576 or 1088 consecutive bytes.
// Rows hold a multiple of 256 values (whole groups) and start 16-byte aligned (checked on
// the host); the type ids TY_Q4_0P / TY_Q8_0P in common.cuh name these layouts.
//
// Launch shape of the products: blockDim.x = 128 (4 warps), one warp per output row,
// gridDim.x = ceil(rows / 4); NT (1, 2, 4, 8) is the widest batch an entry takes.

#define PK_WARPS 4
// Blocks a lane loads before it multiplies: enough bytes in flight per warp to cover the
// memory latency (4 x 512 bytes for Q4_0).
#define PK_UNROLL 4

// 16 bytes of weights that are read once: past L1, which keeps the activations.
__device__ __forceinline__ uint4 ld_stream(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ int dp4a_ss(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Adds this lane's share of row . x[t] to acc[t] for t < nt. Lane l takes blocks l, l + 32,
// ...; each round loads PK_UNROLL blocks' weights before using any.
template <bool Q8, int NT>
__device__ __forceinline__ void pk_row(const u8* row, int cols, const i8* xq,
                                       const float2* xds, int nt, int lane, float (&acc)[NT]) {
    const int group = Q8 ? 272 : 144, qbytes = Q8 ? 32 : 16;
    int nb = cols / 32;
    for (int b0 = lane; b0 < nb; b0 += 32 * PK_UNROLL) {
        uint4 q[PK_UNROLL][Q8 ? 2 : 1];
        float d[PK_UNROLL];
#pragma unroll
        for (int u = 0; u < PK_UNROLL; u++) {
            int b = b0 + 32 * u;
            if (b < nb) {
                const u8* g = row + (size_t)(b >> 3) * group;
                d[u] = h2f(ld16(g + 2 * (b & 7)));
                const u8* qs = g + 16 + qbytes * (b & 7);
                q[u][0] = ld_stream(qs);
                if (Q8) q[u][Q8 ? 1 : 0] = ld_stream(qs + 16);
            }
        }
#pragma unroll
        for (int u = 0; u < PK_UNROLL; u++) {
            int b = b0 + 32 * u;
            if (b >= nb) break;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const int4* xv = (const int4*)(xq + (size_t)t * cols + (size_t)b * 32);
                    int4 xa = xv[0], xb = xv[1];
                    float2 s = xds[(size_t)t * nb + b];
                    int dot;
                    if (Q8) {
                        uint4 lo = q[u][0], hi = q[u][Q8 ? 1 : 0];
                        dot = dp4a_ss((int)lo.x, xa.x, dp4a_ss((int)lo.y, xa.y, 0));
                        dot = dp4a_ss((int)lo.z, xa.z, dp4a_ss((int)lo.w, xa.w, dot));
                        dot = dp4a_ss((int)hi.x, xb.x, dp4a_ss((int)hi.y, xb.y, dot));
                        dot = dp4a_ss((int)hi.z, xb.z, dp4a_ss((int)hi.w, xb.w, dot));
                        acc[t] += d[u] * s.x * (float)dot;
                    } else {
                        // Byte i holds element i (low nibble) and element i + 16 (high).
                        uint4 w = q[u][0];
                        const u32 m = 0x0F0F0F0Fu;
                        dot = dp4a_us(w.x & m, xa.x, dp4a_us((w.x >> 4) & m, xb.x, 0));
                        dot = dp4a_us(w.y & m, xa.y, dp4a_us((w.y >> 4) & m, xb.y, dot));
                        dot = dp4a_us(w.z & m, xa.z, dp4a_us((w.z >> 4) & m, xb.z, dot));
                        dot = dp4a_us(w.w & m, xa.w, dp4a_us((w.w >> 4) & m, xb.w, dot));
                        // Quants are stored + 8: subtract 8 * sum(x), which s.y holds scaled.
                        acc[t] += d[u] * (s.x * (float)dot - 8.f * s.y);
                    }
                }
            }
        }
    }
}

template <int NT>
__device__ __forceinline__ void pk_zero(float (&acc)[NT]) {
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
}

template <bool Q8, int NT>
__device__ void pk_matvec(const u8* w, int rows, int cols, const i8* xq, const float2* xds,
                          int nt, float* out, int accum) {
    pdl_trigger();
    int lane = threadIdx.x & 31, r = blockIdx.x * PK_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    size_t row_bytes = (size_t)(cols / 256) * (Q8 ? 272 : 144);
    pdl_wait();
    float acc[NT];
    pk_zero(acc);
    pk_row<Q8, NT>(w + (size_t)r * row_bytes, cols, xq, xds, nt, lane, acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0 && t < nt) {
            float* o = out + (size_t)t * rows + r;
            *o = accum ? *o + v : v;
        }
    }
}

// q, k and v of one input in one launch: global row R picks the matrix.
template <bool Q8, int NT>
__device__ void pk_matvec3(const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2,
                           int cols, const i8* xq, const float2* xds, int nt, float* o0,
                           float* o1, float* o2) {
    pdl_trigger();
    int lane = threadIdx.x & 31, R = blockIdx.x * PK_WARPS + (threadIdx.x >> 5);
    const u8* w;
    float* out;
    int rows, r;
    if (R < r0) {
        w = w0, out = o0, rows = r0, r = R;
    } else if (R < r0 + r1) {
        w = w1, out = o1, rows = r1, r = R - r0;
    } else if (R < r0 + r1 + r2) {
        w = w2, out = o2, rows = r2, r = R - r0 - r1;
    } else {
        return;
    }
    size_t row_bytes = (size_t)(cols / 256) * (Q8 ? 272 : 144);
    pdl_wait();
    float acc[NT];
    pk_zero(acc);
    pk_row<Q8, NT>(w + (size_t)r * row_bytes, cols, xq, xds, nt, lane, acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0 && t < nt) out[(size_t)t * rows + r] = v;
    }
}

// The feed-forward gate: out[t][r] = silu(gate[r] . x[t]) * (up[r] . x[t]), both rows in
// one warp.
template <bool Q8, int NT>
__device__ void pk_swiglu(const u8* wg, const u8* wu, int rows, int cols, const i8* xq,
                          const float2* xds, int nt, float* out) {
    pdl_trigger();
    int lane = threadIdx.x & 31, r = blockIdx.x * PK_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    size_t at = (size_t)r * (size_t)(cols / 256) * (Q8 ? 272 : 144);
    pdl_wait();
    float g[NT], u[NT];
    pk_zero(g);
    pk_zero(u);
    pk_row<Q8, NT>(wg + at, cols, xq, xds, nt, lane, g);
    pk_row<Q8, NT>(wu + at, cols, xq, xds, nt, lane, u);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float gs = warp_sum(g[t]), us = warp_sum(u[t]);
        if (lane == 0 && t < nt) out[(size_t)t * rows + r] = gs / (1.f + expf(-gs)) * us;
    }
}

#define PK_ENTRIES_Q4_0(nt)                                                               \
    extern "C" __global__ void __launch_bounds__(128) matvecp_q4_0_##nt(                         \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out, int accum) { \
        pk_matvec<false, nt>(w, rows, cols, xq, xds, n, out, accum);                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) matvecp3_q4_0_##nt(                        \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols,              \
        const i8* xq, const float2* xds, int n, float* o0, float* o1, float* o2) {                                  \
        pk_matvec3<false, nt>(w0, w1, w2, r0, r1, r2, cols, xq, xds, n, o0, o1, o2);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) matvecp_swiglu_q4_0_##nt(                  \
        const u8* wg, const u8* wu, int rows, int cols, const i8* xq, const float2* xds, int n, float* out) { \
        pk_swiglu<false, nt>(wg, wu, rows, cols, xq, xds, n, out);                                      \
    }

PK_ENTRIES_Q4_0(1)
PK_ENTRIES_Q4_0(2)
PK_ENTRIES_Q4_0(4)
PK_ENTRIES_Q4_0(8)

#define PK_ENTRIES_Q8_0(nt)                                                               \
    extern "C" __global__ void __launch_bounds__(128) matvecp_q8_0_##nt(                         \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out, int accum) { \
        pk_matvec<true, nt>(w, rows, cols, xq, xds, n, out, accum);                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) matvecp3_q8_0_##nt(                        \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols,              \
        const i8* xq, const float2* xds, int n, float* o0, float* o1, float* o2) {                                  \
        pk_matvec3<true, nt>(w0, w1, w2, r0, r1, r2, cols, xq, xds, n, o0, o1, o2);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) matvecp_swiglu_q8_0_##nt(                  \
        const u8* wg, const u8* wu, int rows, int cols, const i8* xq, const float2* xds, int n, float* out) { \
        pk_swiglu<true, nt>(wg, wu, rows, cols, xq, xds, n, out);                                      \
    }

PK_ENTRIES_Q8_0(1)
PK_ENTRIES_Q8_0(2)
PK_ENTRIES_Q8_0(4)
PK_ENTRIES_Q8_0(8)

// In-place packing of GGUF blocks (BLOCK bytes: a 2-byte scale, then QB bytes of quants)
// into groups of 8. One thread per group: it copies the group into its own slice of shared
// memory, then writes the packed order back over it (rows never share a group, so threads
// never touch each other's bytes). Launch: blockDim.x = PACK_THREADS, any grid
// (grid-stride over n_groups groups); w 16-byte aligned.
#define PACK_THREADS 64

template <int BLOCK, int QB>
__device__ void pack_groups(u8* w, u64 n_groups) {
    const int G = 8 * BLOCK;
    __shared__ uint4 slices[PACK_THREADS * (G / 16)];
    u8* mine = (u8*)(slices + threadIdx.x * (G / 16));
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < n_groups;
         g += (u64)gridDim.x * blockDim.x) {
        const uint4* src = (const uint4*)(w + g * G);
        for (int i = 0; i < G / 16; i++) ((uint4*)mine)[i] = src[i];
        u32* dst = (u32*)(w + g * G);
        for (int k = 0; k < G / 4; k++) {
            u32 word = 0;
#pragma unroll
            for (int t = 0; t < 4; t++) {
                int p = 4 * k + t, from;
                if (p < 16) {
                    from = BLOCK * (p >> 1) + (p & 1);
                } else {
                    int q = p - 16;
                    from = BLOCK * (q / QB) + 2 + q % QB;
                }
                word |= (u32)mine[from] << (8 * t);
            }
            dst[k] = word;
        }
    }
}

extern "C" __global__ void __launch_bounds__(PACK_THREADS) pack_q4_0(u8* w, u64 n_groups) {
    PDL_ENTRY();
    pack_groups<18, 16>(w, n_groups);
}

extern "C" __global__ void __launch_bounds__(PACK_THREADS) pack_q8_0(u8* w, u64 n_groups) {
    PDL_ENTRY();
    pack_groups<34, 32>(w, n_groups);
}
