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
// Launch shape of the products: each warp takes R = 2 consecutive output rows (PK_R), so
// the activation blocks it loads serve two rows; the matvec and q/k/v kernels run
// PK_MV_WARPS warps per block, gridDim.x = ceil(rows / (PK_MV_WARPS * R)) (q/k/v: that per
// matrix, in order); the gate/up kernel runs 32 / R warps per block, 32 rows a block, so
// that one block holds a whole 8-bit block of its output (gridDim.x = ceil(rows / 32)).
// NT (1, 2, 4, 8) is the widest batch an entry takes.
//
// On an H100 (llama3-8b shape, one token), the bytes a lane has in flight decide the speed:
// one row a warp and 4 blocks a round (64 bytes a lane for Q4_0) read 2.0 TB/s in the down
// projection; 4 rows with 2 blocks a round, the same bytes with half the warps, were slower
// still; 2 rows with 4 blocks a round (128 bytes) gave tg128 287 -> 320 t/s for Q4_0 and
// 200 -> 234 for Q8_0. Deeper rounds (8 blocks, or 4 rows of 4) gained nothing for Q4_0 and
// lost for Q8_0 (registers).
#define PK_R 2

__device__ __forceinline__ int dp4a_ss(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The dot product of one packed block (quants q, scale d) with activation block (xa, xb, s).
template <bool Q8>
__device__ __forceinline__ float pk_block_dot(const uint4 (&q)[Q8 ? 2 : 1], float d, int4 xa,
                                              int4 xb, float2 s) {
    int dot;
    if (Q8) {
        uint4 lo = q[0], hi = q[Q8 ? 1 : 0];
        dot = dp4a_ss((int)lo.x, xa.x, dp4a_ss((int)lo.y, xa.y, 0));
        dot = dp4a_ss((int)lo.z, xa.z, dp4a_ss((int)lo.w, xa.w, dot));
        dot = dp4a_ss((int)hi.x, xb.x, dp4a_ss((int)hi.y, xb.y, dot));
        dot = dp4a_ss((int)hi.z, xb.z, dp4a_ss((int)hi.w, xb.w, dot));
        return d * s.x * (float)dot;
    }
    // Byte i holds element i (low nibble) and element i + 16 (high).
    uint4 w = q[0];
    const u32 m = 0x0F0F0F0Fu;
    dot = dp4a_us(w.x & m, xa.x, dp4a_us((w.x >> 4) & m, xb.x, 0));
    dot = dp4a_us(w.y & m, xa.y, dp4a_us((w.y >> 4) & m, xb.y, dot));
    dot = dp4a_us(w.z & m, xa.z, dp4a_us((w.z >> 4) & m, xb.z, dot));
    dot = dp4a_us(w.w & m, xa.w, dp4a_us((w.w >> 4) & m, xb.w, dot));
    // Quants are stored + 8: subtract 8 * sum(x), which s.y holds scaled.
    return d * (s.x * (float)dot - 8.f * s.y);
}

// Adds this lane's share of row[r] . x[t] to acc[r][t] for the R rows from `w` (rows past
// nrows repeat the last one and are never written) and t < nt. Lane l takes blocks l,
// l + 32, ...; each round loads U blocks of every row before using any (U * R * 16 or 32
// bytes a lane: enough in flight to cover the memory latency), and the first
// round's loads are issued before the wait for the previous kernel (weights are constant),
// so they overlap its tail.
template <bool Q8, int NT, int R, int U>
__device__ __forceinline__ void pk_rows(const u8* const (&rowp)[R], int cols, const i8* xq,
                                        const float2* xds, int nt, int lane, bool& waited,
                                        float (&acc)[R][NT]) {
    const int group = Q8 ? 272 : 144, qbytes = Q8 ? 32 : 16;
    int nb = cols / 32;
    for (int b0 = lane; b0 < nb; b0 += 32 * U) {
        uint4 q[U][R][Q8 ? 2 : 1];
        float d[U][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int b = b0 + 32 * u;
            if (b < nb) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const u8* g = rowp[r] + (size_t)(b >> 3) * group;
                    d[u][r] = h2f(ld16(g + 2 * (b & 7)));
                    const u8* qs = g + 16 + qbytes * (b & 7);
                    q[u][r][0] = ld_stream(qs);
                    if (Q8) q[u][r][Q8 ? 1 : 0] = ld_stream(qs + 16);
                }
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int b = b0 + 32 * u;
            if (b >= nb) break;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const int4* xv = (const int4*)(xq + (size_t)t * cols + (size_t)b * 32);
                    int4 xa = xv[0], xb = xv[1];
                    float2 s = xds[(size_t)t * nb + b];
#pragma unroll
                    for (int r = 0; r < R; r++)
                        acc[r][t] += pk_block_dot<Q8>(q[u][r], d[u][r], xa, xb, s);
                }
            }
        }
    }
    if (!waited) {
        pdl_wait();
        waited = true;
    }
}

// The row policy of the drivers in common.cuh for packed Q4_0 (Q8 false) and Q8_0 rows.
template <bool Q8>
struct PkRows {
    __device__ static size_t row_bytes(int cols) { return (size_t)(cols / 256) * (Q8 ? 272 : 144); }
    template <int NT, int R, int U>
    __device__ static void rows(const u8* const (&rowp)[R], int cols, const i8* xq,
                                const float2* xds, int nt, int lane, bool& waited,
                                float (&acc)[R][NT]) {
        pk_rows<Q8, NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, acc);
    }
};

#define PK_MV_ENTRIES(ty, Q8, R, U, nt)                                               \
    extern "C" __global__ void __launch_bounds__(32 * PK_MV_WARPS) matvecp_##ty##_##nt(  \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out, \
        int accum) {                                                                       \
        pk_matvec<PkRows<Q8>, nt, R, U>(w, rows, cols, xq, xds, n, out, accum);                    \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * PK_MV_WARPS) matvecp3_##ty##_##nt( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols,        \
        const i8* xq, const float2* xds, int n, float* o0, float* o1, float* o2) {         \
        pk_matvec3<PkRows<Q8>, nt, R, U>(w0, w1, w2, r0, r1, r2, cols, xq, xds, n, o0, o1, o2);    \
    }

// Registers are capped at 64 for one or two tokens, so two 512-thread blocks share an SM:
// with four 256-thread blocks of 4 rows a warp instead, the only shape that holds all 448
// blocks of a 14336-row feed-forward at once, decode was no faster (and slower for Q8_0).
#define PK_SW_ENTRY(ty, Q8, R, U, nt)                                              \
    extern "C" __global__ void __launch_bounds__(32 * PK_SW_ROWS / R, nt <= 2 ? 2 : 1) \
        matvecp_swiglu_##ty##_##nt(const u8* wg, const u8* wu, int rows, int cols,    \
                                        const i8* xq, const float2* xds, int n, float* out, \
                                        i8* oq, float2* ods, int act) {                    \
        pk_swiglu<PkRows<Q8>, nt, R, U>(wg, wu, rows, cols, xq, xds, n, out, oq, ods, act);     \
    }

#define PK_ENTRIES_Q4_0(nt) PK_MV_ENTRIES(q4_0, false, PK_R, 4, nt) PK_SW_ENTRY(q4_0, false, PK_R, 2, nt)
#define PK_ENTRIES_Q8_0(nt) PK_MV_ENTRIES(q8_0, true, PK_R, 4, nt) PK_SW_ENTRY(q8_0, true, PK_R, 2, nt)

PK_ENTRIES_Q4_0(1)
PK_ENTRIES_Q4_0(2)
PK_ENTRIES_Q4_0(4)
PK_ENTRIES_Q4_0(8)
PK_ENTRIES_Q8_0(1)
PK_ENTRIES_Q8_0(2)
PK_ENTRIES_Q8_0(4)
PK_ENTRIES_Q8_0(8)

// Mixture-of-experts products (common.cuh's moe_swiglu / moe_down) over packed experts.
MOE_ENTRIES(moep, q4_0, PkRows<false>, PK_R, 2, 4)
MOE_ENTRIES(moep, q8_0, PkRows<true>, PK_R, 2, 4)

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
