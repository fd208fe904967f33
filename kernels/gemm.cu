// Prefill matmul on tensor cores: activations are converted to f16, and an f16 x f16 -> f32
// GEMM (mma.sync m16n8k16) multiplies them with the weights. Reusing each weight tile for up
// to 128 tokens is what makes prefill fast; the matvec kernels re-read the weights every few
// tokens. The weights reach the tiles in one of two ways:
// - the gemmq_* kernels decode the quantized blocks (packed Q4_0 / Q8_0 / Q6_K / IQ4_XS,
//   Q4_K, Q5_K) on their way into shared memory, so nothing but the blocks is read and no
//   f16 copy is written;
// - the other types are decoded to an f16 workspace first (gemm_dequant_f16), which the
//   gemm_f16* kernels copy into shared memory.
//
// Workspace layout (both written here, read by the tile kernels): `kp` f16 per row,
// kp = cols rounded up to a multiple of 32 (GEMM_K), the tail zeroed, so the GEMM never
// needs a K edge case and every row starts 64-byte aligned for 16-byte cp.async copies.

#define GEMM_M 128
#define GEMM_N 128
#define GEMM_K 32
#define GEMM_STAGES 3

// decode8 (common.cuh) reads the weights' values 8 at a time.

// v[0..8] as f16 in one 16-byte store at dst (16-byte aligned).
__device__ __forceinline__ void store8_f16(u16* dst, const float* v) {
    uint4 h;
    h.x = (u32)f2h(v[0]) | ((u32)f2h(v[1]) << 16);
    h.y = (u32)f2h(v[2]) | ((u32)f2h(v[3]) << 16);
    h.z = (u32)f2h(v[4]) | ((u32)f2h(v[5]) << 16);
    h.w = (u32)f2h(v[6]) | ((u32)f2h(v[7]) << 16);
    *(uint4*)dst = h;
}

// Decodes rows [0, nr) of w (row_bytes apart, type ty, cols values each) into out
// [nr][kp] f16, zeroing columns cols..kp. Grid-stride over groups of 8 values; kp is a
// multiple of 8, so each group is one 16-byte store.
extern "C" __global__ void gemm_dequant_f16(const u8* __restrict__ w, int ty, u64 row_bytes,
                                            int cols, int kp, int nr, u16* __restrict__ out) {
    PDL_ENTRY();
    u64 groups_per_row = (u64)(kp / 8);
    u64 total = (u64)nr * groups_per_row;
    for (u64 gi = blockIdx.x * (u64)blockDim.x + threadIdx.x; gi < total;
         gi += (u64)gridDim.x * blockDim.x) {
        u64 r = gi / groups_per_row;
        int e0 = (int)(gi % groups_per_row) * 8;
        const u8* row = w + r * row_bytes;
        float v[8];
        if (e0 + 8 <= cols) {
            decode8(ty, row, e0, v);
        } else {
            // Only plain float rows have a partial group (quantized cols are whole blocks).
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = e0 + j < cols ? dequant_at(ty, row, e0 + j) : 0.0f;
        }
        store8_f16(out + r * (u64)kp + e0, v);
    }
}

// x [nt][cols] f32 -> out [nt][kp] f16, columns cols..kp zeroed. Grid-stride over groups
// of 8 values (kp is a multiple of 8), each one 16-byte store; with cols a multiple of 8
// a group is whole or all padding and is read in two 16-byte loads.
extern "C" __global__ void gemm_x_f16(const float* __restrict__ x, int cols, int kp, int nt,
                                      u16* __restrict__ out) {
    PDL_ENTRY();
    int groups_per_row = kp / 8;
    u64 total = (u64)nt * groups_per_row;
    bool whole = (cols & 7) == 0 && ((u64)x & 15) == 0;
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < total;
         g += (u64)gridDim.x * blockDim.x) {
        u64 t = g / groups_per_row;
        int c0 = (int)(g % groups_per_row) * 8;
        const float* row = x + t * cols;
        float v[8];
        if (whole && c0 < cols) {
            float4 a = *(const float4*)(row + c0), b = *(const float4*)(row + c0 + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = c0 + j < cols ? row[c0 + j] : 0.0f;
        }
        store8_f16(out + t * (u64)kp + c0, v);
    }
}

// Byte offset of 16-byte chunk `ch` (0..4) of tile row `row` (64 bytes a row). The XOR
// swizzle puts the 8 rows one ldmatrix reads in 8 different bank groups, without padding
// (padding would push 3 stages past the 48 KiB of static shared memory).
__device__ __forceinline__ u32 tile_off(int row, int ch) {
    return (u32)(row * 64 + ((ch ^ ((row >> 1) & 3)) << 4));
}

// Copies the K-tile kt (GEMM_K values) of ROWS rows starting at row0 of src ([nrows][kp]
// f16) into the shared tile at `tile`, THREADS threads sharing the 16-byte pieces; rows >=
// nrows read as zeros.
template <int THREADS, int ROWS>
__device__ __forceinline__ void load_tile(u32 tile, const u16* src, int row0, int nrows,
                                          int kp, int kt) {
    static_assert((ROWS * GEMM_K / 8) % THREADS == 0, "whole pieces a thread");
#pragma unroll
    for (int i = 0; i < (ROWS * GEMM_K / 8) / THREADS; i++) {
        int idx = threadIdx.x + i * THREADS;
        int row = idx >> 2, ch = idx & 3;
        int gr = row0 + row;
        bool ok = gr < nrows;
        const u16* p = src + (u64)(ok ? gr : 0) * kp + kt * GEMM_K + ch * 8;
        cp_async16(tile + tile_off(row, ch), p, ok ? 16 : 0);
    }
}

// 16 bytes of weights from global memory. Volatile, so the load is issued where written:
// before the tile kernel's products of the current K tile (also volatile), not sunk to its
// use. Unlike ld_stream it allocates in L1: the next K tiles read the rest of the line.
__device__ __forceinline__ uint4 ldg16(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 8 bytes of weights from global memory, as ldg16.
__device__ __forceinline__ uint2 ldg8(const u8* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// The 32 bytes at p, which is only 2-byte aligned (Q6_K's 210-byte blocks in GGUF's
// layout), from the three aligned 16-byte loads that cover them: the words are picked by
// selects on the offset (a runtime index would put them in local memory) and shifted into
// place. The third load ends within 15 bytes of p + 32, inside the block for every span
// QTile reads.
__device__ __forceinline__ void ldg32_u2(const u8* p, uint4& lo, uint4& hi) {
    const u8* base = (const u8*)((u64)p & ~(u64)15);
    const int sh = (int)((u64)p & 15), q = sh >> 2, bits = 8 * (sh & 3);
    const uint4 a = ldg16(base), b = ldg16(base + 16), c = ldg16(base + 32);
    const u32 w[12] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, c.x, c.y, c.z, c.w};
    u32 v[9];
#pragma unroll
    for (int i = 0; i < 9; i++) v[i] = q == 0 ? w[i] : q == 1 ? w[i + 1] : q == 2 ? w[i + 2] : w[i + 3];
    u32 o[8];
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = __funnelshift_r(v[i], v[i + 1], bits);
    lo = make_uint4(o[0], o[1], o[2], o[3]);
    hi = make_uint4(o[4], o[5], o[6], o[7]);
}

// Halfword j (0..8) of the 16 bytes v.
__device__ __forceinline__ u16 half_of(uint4 v, int j) {
    const u32 w = (j & 4) ? ((j & 2) ? v.w : v.z) : ((j & 2) ? v.y : v.x);
    return (u16)(w >> (16 * (j & 1)));
}

// One weight row's 32 values of a K tile, for the types the tile kernels decode (packed
// Q4_0 / Q8_0 / Q6_K / IQ4_XS, Q4_K, Q5_K: blocks whose quants lie 16-byte aligned), held
// in registers from their load, issued before the products of the current K tile, to their
// store as f16 into shared memory after them, so the loads' latency hides behind the
// products. Each of the
// GEMM_M threads takes one row, and K tiles in order: the 32 rows of a warp's load are 32
// cache lines, which bound the kernel when it loads more than ~2 times a K tile (ncu, H100:
// 76% memory-pipe busy with 6), so what later K tiles share (a group's scales, a Q4_K
// pair's quant bytes, Q5_K's and Q6_K's high bits, a block's scales) is loaded once and
// kept.
template <int TY>
struct QTile {
    uint4 q[2], hb[2], sw, sb;
    uint2 head;
    int kt, have_q = -1, have_s = -1, have_b = -1;

    __device__ __forceinline__ void fetch(const u8* row, int k_tile) {
        kt = k_tile;
        if constexpr (TY == TY_Q4_0P || TY == TY_Q8_0P) {
            constexpr int GROUP = TY == TY_Q4_0P ? 144 : 272, QB = TY == TY_Q4_0P ? 16 : 32;
            const u8* g = row + (kt >> 3) * GROUP;
            if ((kt >> 3) != have_s) {
                sw = ldg16(g);
                have_s = kt >> 3;
            }
            q[0] = ldg16(g + 16 + QB * (kt & 7));
            if constexpr (TY == TY_Q8_0P) q[1] = ldg16(g + 32 + QB * (kt & 7));
        } else if constexpr (TY == TY_Q6_KP) {
            // Groups of 8 blocks: their 8 f16 d, then each block's ql (128), qh (64) and
            // scales (16). K tile kt is half h = (kt & 7) / 4, quarter k = kt & 3 of block
            // kt / 8: ql bytes 64h + 32(k & 1).. (nibble k / 2), qh bytes 32h.. (bits 2k).
            const int n = kt >> 3, h = (kt >> 2) & 1, k = kt & 3;
            const u8* g = row + (n >> 3) * 1680;
            const u8* b = g + 16 + 208 * (n & 7);
            if ((n >> 3) != have_s) {
                sw = ldg16(g);
                have_s = n >> 3;
            }
            if (n != have_b) {
                sb = ldg16(b + 192);
                have_b = n;
            }
            if ((kt >> 2) != have_q) {
                hb[0] = ldg16(b + 128 + 32 * h);
                hb[1] = ldg16(b + 144 + 32 * h);
                have_q = kt >> 2;
            }
            q[0] = ldg16(b + 64 * h + 32 * (k & 1));
            q[1] = ldg16(b + 64 * h + 32 * (k & 1) + 16);
        } else if constexpr (TY == TY_Q6_K) {
            // GGUF's 210-byte blocks (ql 128, qh 64, 16 scales, d), 2-byte aligned: the same
            // halves and quarters as the packed layout, each block's d and K tile kt's two
            // scale bytes in sw.x and sw.y.
            const int n = kt >> 3, h = (kt >> 2) & 1, k = kt & 3;
            const u8* b = row + (size_t)n * 210;
            if (n != have_b) {
                sw.x = ld16(b + 208);
                have_b = n;
            }
            sw.y = ld16(b + 192 + 8 * h + 2 * k);
            if ((kt >> 2) != have_q) {
                ldg32_u2(b + 128 + 32 * h, hb[0], hb[1]);
                have_q = kt >> 2;
            }
            ldg32_u2(b + 64 * h + 32 * (k & 1), q[0], q[1]);
        } else if constexpr (TY == TY_IQ4_XSP) {
            // Groups of 8 blocks: their 8-byte headers (d, scales_h, scales_l), then each
            // block's 128 quant bytes, 16 per K tile (low nibbles values 0-15, high 16-31).
            const int n = kt >> 3;
            const u8* g = row + (n >> 3) * 1088;
            if (n != have_b) {
                head = ldg8(g + 8 * (n & 7));
                have_b = n;
            }
            q[0] = ldg16(g + 64 + 128 * (n & 7) + 16 * (kt & 7));
        } else {
            constexpr bool FIVE = TY == TY_Q5_K;
            const u8* b = row + (kt >> 3) * (FIVE ? 176 : 144);
            if ((kt >> 1) != have_q) {
                const u8* qs = b + (FIVE ? 48 : 16) + 32 * ((kt & 7) >> 1);
                q[0] = ldg16(qs);
                q[1] = ldg16(qs + 16);
                have_q = kt >> 1;
            }
            if ((kt >> 3) != have_s) {
                sw = ldg16(b);
                if constexpr (FIVE) {
                    hb[0] = ldg16(b + 16);
                    hb[1] = ldg16(b + 32);
                }
                have_s = kt >> 3;
            }
        }
    }

    // Block kt's f16 scale among the 8 of a packed group's header (registers only: a
    // runtime index into an array would put it in local memory).
    __device__ __forceinline__ u16 block_scale() const { return half_of(sw, kt & 7); }

    // The 32 values as f16 (scale x quant - min) in order at row `row` of the tile: the
    // byte permute puts a quant byte under the f16 exponent of 1024, so one subtraction
    // makes it an exact f16 and one multiply-add scales it.
    __device__ __forceinline__ void store(u32 tile, int row) const {
        // Values 8c.. take scale sc[c / 2] (Q6_K's scales cover 16 values, the others' 32).
        u32 w[8], bias, sc[2], nm = 0;
        if constexpr (TY == TY_Q4_0P || TY == TY_IQ4_XSP) {
            const u32 x[4] = {q[0].x, q[0].y, q[0].z, q[0].w};
            if constexpr (TY == TY_Q4_0P) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    w[i] = x[i] & 0x0F0F0F0Fu;
                    w[4 + i] = (x[i] >> 4) & 0x0F0F0F0Fu;
                }
                bias = 0x64086408u;  // 1024 + 8: the quants are offset by 8
                sc[0] = h2_of(h2f(block_scale()));
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int lo, hi;
                    iq4_values(x[i], &lo, &hi);
                    w[i] = (u32)lo ^ 0x80808080u;  // signed + 128
                    w[4 + i] = (u32)hi ^ 0x80808080u;
                }
                bias = 0x64806480u;
                const int ib = kt & 7;
                const int low = (head.y >> (4 * ib)) & 15, high = (head.x >> (16 + 2 * ib)) & 3;
                sc[0] = h2_of(h2f((u16)head.x) * (float)((low | (high << 4)) - 32));
            }
            sc[1] = sc[0];
        } else if constexpr (TY == TY_Q8_0P) {
            const u32 x[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] = x[i] ^ 0x80808080u;  // signed + 128
            bias = 0x64806480u;
            sc[0] = sc[1] = h2_of(h2f(block_scale()));
        } else if constexpr (TY == TY_Q6_KP || TY == TY_Q6_K) {
            const int h = (kt >> 2) & 1, k = kt & 3, shift = 4 * (k >> 1);
            const u32 x[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
            const u32 y[8] = {hb[0].x, hb[0].y, hb[0].z, hb[0].w, hb[1].x, hb[1].y, hb[1].z, hb[1].w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                w[i] = ((x[i] >> shift) & 0x0F0F0F0Fu) | (((y[i] >> (2 * k)) & 0x03030303u) << 4);
            }
            bias = 0x64206420u;  // 1024 + 32: the quants are offset by 32
            if constexpr (TY == TY_Q6_K) {
                const float d = h2f((u16)sw.x);
#pragma unroll
                for (int i = 0; i < 2; i++) sc[i] = h2_of(d * (float)(i8)(sw.y >> (8 * i)));
            } else {
                const float d = h2f(half_of(sw, (kt >> 3) & 7));
                // Scales 8h + 2k and the next, signed bytes of sb.
                const int j = 8 * h + 2 * k;
                const u32 lo = j < 8 ? sb.x : sb.z, hi = j < 8 ? sb.y : sb.w;
#pragma unroll
                for (int i = 0; i < 2; i++) sc[i] = h2_of(d * (float)(i8)byte_of(lo, hi, j + i));
            }
        } else {
            const int sub = kt & 7, shift = 4 * (sub & 1);
            const u32 x[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
            const u32 h[8] = {hb[0].x, hb[0].y, hb[0].z, hb[0].w, hb[1].x, hb[1].y, hb[1].z, hb[1].w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                w[i] = (x[i] >> shift) & 0x0F0F0F0Fu;
                if constexpr (TY == TY_Q5_K) w[i] |= ((h[i] >> sub) & 0x01010101u) << 4;
            }
            // scale_min_k4 over the 12 scale bytes in sw.y..w, with register byte picks.
            int s, m;
            if (sub < 4) {
                s = byte_of(sw.y, sw.z, sub) & 63;
                m = byte_of(sw.y, sw.z, sub + 4) & 63;
            } else {
                s = (byte_of(sw.w, sw.w, sub + 4) & 15) | ((byte_of(sw.y, sw.z, sub - 4) >> 6) << 4);
                m = (byte_of(sw.w, sw.w, sub + 4) >> 4) | ((byte_of(sw.y, sw.z, sub) >> 6) << 4);
            }
            bias = 0x64006400u;
            sc[0] = sc[1] = h2_of(h2f((u16)sw.x) * (float)s);
            nm = h2_of(-h2f((u16)(sw.x >> 16)) * (float)m);
        }
#pragma unroll
        for (int c = 0; c < 4; c++) {
            u32 v[4];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const u32 u = w[2 * c + j];
                v[2 * j] = h2_fma(h2_sub(__byte_perm(u, 0x64646464u, 0x4140), bias), sc[c >> 1], nm);
                v[2 * j + 1] = h2_fma(h2_sub(__byte_perm(u, 0x64646464u, 0x4342), bias), sc[c >> 1], nm);
            }
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + tile_off(row, c)),
                         "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
        }
    }
};

// No weight type: the weights are the f16 workspace, copied with cp.async.
#define TY_WORKSPACE (-1)

// acc = the products of the tile's 128 weight rows (from bm) and BN tokens (from bn) over K
// tiles [k0, k0 + nk), through the shared stages sa and sb: a is the decoded weight chunk
// [m_rows][kp] (TY_WORKSPACE), or, for a decoding kernel, the weight whose row `row` (the
// last one past m_rows) this thread decodes, rows a_row_bytes apart; b the f16 tokens
// [n_cols][kp] (kp a multiple of GEMM_K, rows 64-byte aligned). Warp w computes rows
// (w & 1) * 64.. and tokens (w >> 1) * BN / WARPS_N.., acc[mi][ni][c] at m = mi * 16 +
// lane / 4 (+8 for c 2, 3), n = ni * 8 + 2 * (lane % 4) (+1 for odd c) of that. Wider warp
// tiles read shared memory less per mma but hold more registers.
template <int WARPS_N, int TY, int BN>
__device__ __forceinline__ void gemm_tile(u16 (*sa)[GEMM_M * GEMM_K], u16 (*sb)[BN * GEMM_K],
                                          const u8* __restrict__ a, u64 a_row_bytes, int row,
                                          const u16* __restrict__ b, int bm, int bn, int m_rows,
                                          int n_cols, int kp, int k0, int nk,
                                          float (&acc)[4][BN / WARPS_N / 8][4]) {
    constexpr int THREADS = 64 * WARPS_N;
    constexpr int WARP_N = BN / WARPS_N;
    constexpr int NI = WARP_N / 8;
    static_assert(NI % 2 == 0, "ldmatrix_x4 takes two 8-wide n tiles");

    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = (warp & 1) * 64, wn = (warp >> 1) * WARP_N;

#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;

    u32 sa0 = smem_addr(&sa[0][0]), sb0 = smem_addr(&sb[0][0]);
    const u32 stage_bytes = GEMM_M * GEMM_K * 2, b_stage_bytes = BN * GEMM_K * 2;

    const u16* a16 = (const u16*)a;
    // A decoding kernel's thread reads one weight row (rows past the end read the last;
    // their sums are never written).
    static_assert(TY == TY_WORKSPACE || THREADS == GEMM_M, "one weight row a thread");
    const u8* arow = a + (u64)min(row, m_rows - 1) * a_row_bytes;
    QTile<TY> qt;
#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; s++) {
        if (s < nk) {
            if constexpr (TY == TY_WORKSPACE) {
                load_tile<THREADS, GEMM_M>(sa0 + s * stage_bytes, a16, bm, m_rows, kp, k0 + s);
            } else {
                qt.fetch(arow, k0 + s);
                qt.store(sa0 + s * stage_bytes, threadIdx.x);
            }
            load_tile<THREADS, BN>(sb0 + s * b_stage_bytes, b, bn, n_cols, kp, k0 + s);
        }
        // Empty groups keep the wait count below uniform.
        cp_async_commit();
    }

    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<GEMM_STAGES - 2>();
        // Tile kt is visible to every warp, and every warp is done with tile kt - 1, whose
        // stage the prefetch below overwrites.
        __syncthreads();
        int next = kt + GEMM_STAGES - 1;
        if (next < nk) {
            int s = next % GEMM_STAGES;
            if constexpr (TY == TY_WORKSPACE) {
                load_tile<THREADS, GEMM_M>(sa0 + s * stage_bytes, a16, bm, m_rows, kp, k0 + next);
            } else {
                qt.fetch(arow, k0 + next);
            }
            load_tile<THREADS, BN>(sb0 + s * b_stage_bytes, b, bn, n_cols, kp, k0 + next);
        }
        cp_async_commit();

        u32 ta = sa0 + (kt % GEMM_STAGES) * stage_bytes;
        u32 tb = sb0 + (kt % GEMM_STAGES) * b_stage_bytes;
#pragma unroll
        for (int kk = 0; kk < GEMM_K / 16; kk++) {
            u32 af[4][4], bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                // Lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15:
                // the four 8x8 matrices land in mma's A fragment order.
                int row = wm + mi * 16 + (lane & 15);
                ldmatrix_x4(ta + tile_off(row, kk * 2 + (lane >> 4)), af[mi]);
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; nj++) {
                // Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                // = b0, b1 of two 8-wide n tiles.
                int row = wn + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
                u32 r[4];
                ldmatrix_x4(tb + tile_off(row, kk * 2 + ((lane >> 3) & 1)), r);
                bf[nj * 2][0] = r[0];
                bf[nj * 2][1] = r[1];
                bf[nj * 2 + 1][0] = r[2];
                bf[nj * 2 + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) mma_16816(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
        }
        // Stage `next` was last read in iteration kt - 1, which every warp finished before
        // this iteration's barrier; the next barrier makes the store visible.
        if constexpr (TY != TY_WORKSPACE) {
            if (next < nk) qt.store(sa0 + (next % GEMM_STAGES) * stage_bytes, threadIdx.x);
        }
    }
    cp_async_wait<0>();
}

// out[n][m] (row stride ldo) = acc of the tile at (bm, bn) for m < m_rows, n < n_cols,
// added to what out holds when `accumulate`. Lanes of one store write 8 consecutive m, so
// every 32-byte sector is whole.
template <int WARPS_N, int BN>
__device__ __forceinline__ void gemm_store(const float (&acc)[4][BN / WARPS_N / 8][4], int bm,
                                           int bn, int m_rows, int n_cols,
                                           float* __restrict__ out, int ldo, int accumulate) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = (warp & 1) * 64, wn = (warp >> 1) * (BN / WARPS_N);
    int gid = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < BN / WARPS_N / 8; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int m = bm + wm + mi * 16 + gid + (c >= 2 ? 8 : 0);
                int n = bn + wn + ni * 8 + tq * 2 + (c & 1);
                if (m < m_rows && n < n_cols) {
                    float* o = out + (u64)n * ldo + m;
                    *o = accumulate ? *o + acc[mi][ni][c] : acc[mi][ni][c];
                }
            }
}

// out[n][m] (row stride ldo) = sum_k a[m][k] * b[n][k] for m < m_rows, n < n_cols (a and b
// as gemm_tile takes them).
// Launch: grid (ceil(n_cols / BN), ceil(m_rows / 128), splits), 64 * WARPS_N threads, no
// dynamic shared memory. Token tiles vary fastest so the blocks resident together share
// one weight tile, which is then read from memory once. The warps form 2 (m) x WARPS_N
// (n); each computes 64 (m) x BN / WARPS_N (n). BN (tokens a tile) is GEMM_N but for the
// decoding kernels' narrow variants: a batch of 9-64 tokens (many sequences decoding at
// once) in a 128-token tile spent 2-4x the tensor-core work it needed.
// Split-K: block z sums K tiles [z * k_tiles, (z + 1) * k_tiles) and writes its partial
// at out + z * split_stride (gemm_reduce adds them); with one split that is the result,
// added to what out holds when `accumulate` (a residual add with no pass of its own).
// GROUPED (the narrow variants): rows [0, e0) of the product are a's, [e0, e1) a1's and
// [e1, m_rows) a2's, rows a_row_bytes apart in each: up to three weights of one type and K
// times the same tokens in one launch (q/k/v, gate/up). e0 and e1 are multiples of
// GEMM_M, so no tile straddles two weights; one weight passes e0 = e1 = m_rows.
template <int WARPS_N, int TY, int BN, bool GROUPED>
__device__ __forceinline__ void gemm_block(const u8* __restrict__ a, u64 a_row_bytes,
                                           const u16* __restrict__ b, int m_rows, int n_cols,
                                           int kp, int k_tiles, float* __restrict__ out, int ldo,
                                           u64 split_stride, int accumulate, const u8* a1,
                                           const u8* a2, int e0, int e1) {
    __shared__ __align__(128) u16 sa[GEMM_STAGES][GEMM_M * GEMM_K];
    __shared__ __align__(128) u16 sb[GEMM_STAGES][BN * GEMM_K];
    PDL_ENTRY();
    int bn = blockIdx.x * BN, bm = blockIdx.y * GEMM_M;
    // This split's K tiles: [k0, k0 + nk); nk <= 0 leaves a zero partial, still written.
    int k0 = blockIdx.z * k_tiles;
    int nk = min(kp / GEMM_K - k0, k_tiles);
    out += blockIdx.z * split_stride;
    float acc[4][BN / WARPS_N / 8][4];
    // The weight this tile's rows are in: its rows [first, end) of the product.
    const u8* w = a;
    int first = 0, end = m_rows;
    if constexpr (GROUPED) {
        end = e0;
        if (bm >= e1) {
            w = a2, first = e1, end = m_rows;
        } else if (bm >= e0) {
            w = a1, first = e0, end = e1;
        }
    }
    gemm_tile<WARPS_N, TY, BN>(sa, sb, w, a_row_bytes, bm - first + (int)threadIdx.x, b,
                               bm - first, bn, end - first, n_cols, kp, k0, nk, acc);
    gemm_store<WARPS_N, BN>(acc, bm, bn, m_rows, n_cols, out, ldo, accumulate);
}

// Every tile kernel takes (a, a_row_bytes, b, m_rows, n_cols, kp, k_tiles, out, ldo,
// split_stride, accumulate); a_row_bytes is 2 * kp for the f16 workspace. The narrow
// variants also take (a1, a2, e0, e1), gemm_block's GROUPED weights.
#define GEMM_ENTRY_BN(name, warps_n, ty, bn, blocks)                                           \
    extern "C" __global__ void __launch_bounds__(64 * warps_n, blocks)                         \
        name(const u8* __restrict__ a, u64 a_row_bytes, const u16* __restrict__ b, int m_rows, \
             int n_cols, int kp, int k_tiles, float* __restrict__ out, int ldo,                 \
             u64 split_stride, int accumulate) {                                                \
        gemm_block<warps_n, ty, bn, false>(a, a_row_bytes, b, m_rows, n_cols, kp, k_tiles, out, \
                                           ldo, split_stride, accumulate, a, a, m_rows, m_rows); \
    }
#define GEMM_ENTRY(name, warps_n, ty) GEMM_ENTRY_BN(name, warps_n, ty, GEMM_N, 2)
#define GEMM_ENTRY_GROUPED(name, ty, bn)                                                        \
    extern "C" __global__ void __launch_bounds__(128, GEMM_NARROW_BLOCKS)                       \
        name(const u8* __restrict__ a, u64 a_row_bytes, const u16* __restrict__ b, int m_rows, \
             int n_cols, int kp, int k_tiles, float* __restrict__ out, int ldo,                 \
             u64 split_stride, int accumulate, const u8* a1, const u8* a2, int e0, int e1) {    \
        gemm_block<2, ty, bn, true>(a, a_row_bytes, b, m_rows, n_cols, kp, k_tiles, out, ldo,   \
                                    split_stride, accumulate, a1, a2, e0, e1);                  \
    }
// A decoding kernel's narrow variants, name_n32 and name_n64: tiles of 32 and 64 tokens,
// GEMM_NARROW_BLOCKS blocks a multiprocessor (their accumulators and token tiles are a
// quarter and a half of the wide kernel's, and more blocks keep more weight loads in
// flight). On an H100 (llama3-8b, 32 sequences) 4 blocks beat 3 and 2, and a second
// register set of weight tiles in flight gained 1% on Q4_0 and lost 11% on Q4_K. What
// bounds them (ncu, Q4_0, 32 tokens) is the L1 pipe, 79% busy, while DRAM reads 1 TB/s:
// a warp's weight load touches 32 rows (32 lines), and the f16 tile's stores and ldmatrix
// reads go through it as well, for 32 tokens of products instead of 128.
#define GEMM_NARROW_BLOCKS 4
#define GEMM_NARROW(name, ty)                    \
    GEMM_ENTRY_GROUPED(name##_n32, ty, 32)       \
    GEMM_ENTRY_GROUPED(name##_n64, ty, 64)

// 8 warps of 64 x 32 (256 threads) or 4 of 64 x 64 (128), two blocks per multiprocessor.
GEMM_ENTRY(gemm_f16, 4, TY_WORKSPACE)
GEMM_ENTRY(gemm_f16_wide, 2, TY_WORKSPACE)
// The weight types QTile decodes, in the tile kernel: 4 warps of 64 x 64, a row a thread.
GEMM_ENTRY(gemmq_q4_0p, 2, TY_Q4_0P)
GEMM_ENTRY(gemmq_q8_0p, 2, TY_Q8_0P)
GEMM_ENTRY(gemmq_q4_k, 2, TY_Q4_K)
GEMM_ENTRY(gemmq_q5_k, 2, TY_Q5_K)
GEMM_ENTRY(gemmq_q6_kp, 2, TY_Q6_KP)
GEMM_ENTRY(gemmq_iq4_xsp, 2, TY_IQ4_XSP)
GEMM_NARROW(gemmq_q4_0p, TY_Q4_0P)
GEMM_NARROW(gemmq_q8_0p, TY_Q8_0P)
GEMM_NARROW(gemmq_q4_k, TY_Q4_K)
GEMM_NARROW(gemmq_q5_k, TY_Q5_K)
GEMM_NARROW(gemmq_q6_kp, TY_Q6_KP)
GEMM_NARROW(gemmq_iq4_xsp, TY_IQ4_XSP)

// Value i of the splits' partials p (split_stride apart), summed in split order so the
// result does not depend on scheduling.
__device__ __forceinline__ float split_sum(const float* __restrict__ p, int splits,
                                           u64 split_stride, u64 i) {
    float sum = 0.0f;
    for (int z = 0; z < splits; z++) sum += p[z * split_stride + i];
    return sum;
}

// out[t][r] (row stride ldo) = sum over z < splits of p[z][t][r], p holding splits partials
// [nt][nr] of gemm_f16, split_stride = nt * nr apart. Summed in split order, so the result
// does not depend on scheduling; added to what out holds when `accumulate`. Grid-stride
// over nt * nr values.
extern "C" __global__ void gemm_reduce(const float* __restrict__ p, int splits,
                                       u64 split_stride, int nr, int nt,
                                       float* __restrict__ out, int ldo, int accumulate) {
    PDL_ENTRY();
    u64 total = (u64)nt * nr;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        float sum = split_sum(p, splits, split_stride, i);
        float* o = out + (i / nr) * ldo + i % nr;
        *o = accumulate ? *o + sum : sum;
    }
}

// The sums of a GROUPED product's partials (as gemm_reduce, p holding [nt][nr] values a
// split): value (t, r) goes to out0 [nt][e0], out1 [nt][e1 - e0] or out2 [nt][nr - e1], by
// the weight row r is in. Grid-stride over nt * nr values.
extern "C" __global__ void gemm_reduce3(const float* __restrict__ p, int splits,
                                        u64 split_stride, int nr, int nt, int e0, int e1,
                                        float* __restrict__ out0, float* __restrict__ out1,
                                        float* __restrict__ out2) {
    PDL_ENTRY();
    u64 total = (u64)nt * nr;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        float sum = split_sum(p, splits, split_stride, i);
        u64 t = i / nr;
        int r = (int)(i % nr);
        if (r < e0) {
            out0[t * e0 + r] = sum;
        } else if (r < e1) {
            out1[t * (e1 - e0) + r - e0] = sum;
        } else {
            out2[t * (nr - e1) + r - e1] = sum;
        }
    }
}

// A gated feed-forward from a GROUPED gate/up product's partials (rows [0, ff) gate,
// [ff, 2 ff) up, p holding [nt][2 ff] values a split): out[t][r] = act(gate) * up, summed
// in split order as gemm_reduce sums. Grid-stride over nt * ff values.
extern "C" __global__ void gemm_reduce_gated(const float* __restrict__ p, int splits,
                                             u64 split_stride, int ff, int nt, int act,
                                             float* __restrict__ out) {
    PDL_ENTRY();
    u64 total = (u64)nt * ff;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 at = i / ff * 2 * ff + i % ff;
        float g = split_sum(p, splits, split_stride, at);
        out[i] = gate_act(g, act) * split_sum(p, splits, split_stride, at + ff);
    }
}
